"""The ONNX drafter schedules like the PyTorch drafter it was exported from: the checkpoint's
confidence model (``confidence.json``) and calibrator (``calibration.json``) travel with the graphs
(manifest ``scheduling``, checksummed), so per-position c_j, survival a_j and the scheduled ℓ are
equal between the two on the same rounds."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("onnx", reason="export tests need onnx: pip install 'dspark[onnx]'")
pytest.importorskip("onnxruntime", reason="export tests need onnxruntime: pip install 'dspark[onnx]'")

import dspark  # noqa: E402
from dspark.calibration import STSBiasCalibrator  # noqa: E402
from dspark.confidence import HeadMaxProbConfidence, StackedConfidence  # noqa: E402
from dspark.drafters.checkpoint import from_pretrained, save_pretrained  # noqa: E402
from dspark.evaluation.drafter_specs import calibrator_beside  # noqa: E402
from dspark.export import ExportError, OrtDrafter, export_onnx  # noqa: E402
from dspark.plugins import resolve  # noqa: E402
from dspark.protocols import DraftContext, TargetFeatures  # noqa: E402
from dspark.schedulers import build_schedule  # noqa: E402
from dspark.targets import HFTarget  # noqa: E402
from dspark.types import SamplingParams  # noqa: E402
from helpers import tiny_causal_lm  # noqa: E402

V, GAMMA = 64, 4
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return HFTarget(tiny_causal_lm("llama", vocab_size=V, max_positions=96, init_range=0.3))


def _checkpoint(target, folder, confidence):
    """A DSpark checkpoint folder with a confidence head, ``confidence.json`` and ``calibration.json``."""
    torch.manual_seed(3)
    d = dspark.get_drafter("dspark", target=target, num_layers=2, gamma=GAMMA, rank=16, head="gated-markov")
    for p in d.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.2)
    save_pretrained(d, folder)
    if confidence == "head-max-prob":
        HeadMaxProbConfidence([(1.1, 0.6, 0.4), (0.9, 0.8, -0.2), (1.3, 0.2, 0.1), (0.7, 1.0, -0.5)]).save(
            folder / "confidence.json")
    else:
        StackedConfidence(("head", "max-prob", "margin"), [[0.5, 0.8, 0.2, -0.1, 0.05, -0.02, 0.3]] * GAMMA,
                          [0.0, 0.4, 1.5], [1.0, 2.0, 1.8], True).save(folder / "confidence.json")
    STSBiasCalibrator(temperatures=(1.5, 0.8, 2.0, 1.2), biases=(0.3, -0.4, 0.1, 0.6)).save(folder / "calibration.json")
    return folder


def _rounds(d, F, n_ctx=(5, 11, 17, 23)):
    """One round for four requests with synthetic target features of width F (fixed seed)."""
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, V, (n + 1,), generator=gen) for n in n_ctx]
    feats = [3.0 * torch.randn(n, F, generator=gen) for n in n_ctx]
    rids = [f"r{i}" for i in range(len(n_ctx))]
    block = d.draft(DraftContext(rids, ids, [SamplingParams.greedy()] * len(rids), features=TargetFeatures(feats)))
    for r in rids:
        d.release(r)
    return block


def _schedule(d, folder, block):
    """(c, a, ℓ) as dspark.Engine computes them: the drafter's confidence model, the folder's
    calibrator (calibrator_beside), sps-greedy under the sps-table cost model."""
    raw = d.confidence_model.confidence_logits(block)
    cal = calibrator_beside(folder, d.confidence_model) or resolve("calibrators", "identity")
    c = cal.calibrate(raw)
    plan = build_schedule(resolve("schedulers", "sps-greedy"), c, block.valid_lengths, resolve("cost_models", "sps-table"))
    return c, plan.survival, plan.lengths


@pytest.mark.parametrize("confidence", ["head-max-prob", "stacked"])
def test_onnx_drafter_schedules_like_the_pytorch_drafter(target, tmp_path, confidence):
    ckpt = _checkpoint(target, tmp_path / "ckpt", confidence)
    pt = from_pretrained(ckpt, target)
    assert pt.confidence_model is not None
    out = tmp_path / "onnx"
    manifest = export_onnx(pt, out, target_spec="tiny-llama", checkpoint=ckpt)
    assert set(manifest["scheduling"]) == {"confidence", "calibration"}
    ort = OrtDrafter.from_dir(out, threads=1)
    assert ort.confidence_model == pt.confidence_model
    assert calibrator_beside(out, ort.confidence_model) == calibrator_beside(ckpt, pt.confidence_model)
    F = len(pt.config.target_layer_ids) * pt.config.layer.hidden_size
    b_pt, b_ort = _rounds(pt, F), _rounds(ort, F)
    assert torch.equal(b_pt.tokens, b_ort.tokens)
    c_pt, a_pt, l_pt = _schedule(pt, ckpt, b_pt)
    c_ort, a_ort, l_ort = _schedule(ort, out, b_ort)
    torch.testing.assert_close(c_ort, c_pt, atol=1e-5, rtol=0)
    torch.testing.assert_close(a_ort, a_pt, atol=1e-5, rtol=0)
    assert l_ort.tolist() == l_pt.tolist()
    assert 0.02 < float(c_pt.min()) and float(c_pt.max()) < 0.98  # confidences that a scheduler weighs
    assert len(set(l_pt.tolist())) > 1 or 0 < int(l_pt[0]) < GAMMA  # ℓ decided, not all-or-nothing


def test_a_changed_scheduling_file_is_refused_and_the_engine_uses_the_model(target, tmp_path):
    ckpt = _checkpoint(target, tmp_path / "ckpt", "stacked")
    pt = from_pretrained(ckpt, target)
    out = tmp_path / "onnx"
    export_onnx(pt, out, checkpoint=ckpt)
    ort = OrtDrafter.from_dir(out, threads=1)
    assert dspark.Engine(target, ort).confidence_model == pt.confidence_model  # the engine's default
    data = json.loads((out / "confidence.json").read_text())
    data["weights"][0][0] += 1.0
    (out / "confidence.json").write_text(json.dumps(data))
    with pytest.raises(ExportError, match="confidence.json does not match its checksum"):
        OrtDrafter.from_dir(out, threads=1)


def test_a_vocabulary_cut_keeps_only_the_calibration(target, tmp_path):
    """A drafter without a confidence model (a vocabulary cut, whose proxy features differ) exports
    the calibration alone, as from_pretrained applies it."""
    ckpt = _checkpoint(target, tmp_path / "ckpt", "head-max-prob")
    pt = from_pretrained(ckpt, target)
    pt.confidence_model = None
    manifest = export_onnx(pt, tmp_path / "onnx", checkpoint=ckpt)
    assert set(manifest["scheduling"]) == {"calibration"} and not (tmp_path / "onnx" / "confidence.json").exists()
    ort = OrtDrafter.from_dir(tmp_path / "onnx", threads=1)
    assert ort.confidence_model is None
    assert calibrator_beside(tmp_path / "onnx", None) == calibrator_beside(ckpt, None)
    # a re-export without a checkpoint leaves no stale scheduling file behind
    export_onnx(pt, tmp_path / "onnx")
    assert not (tmp_path / "onnx" / "calibration.json").exists()


def test_exporting_into_the_checkpoint_folder_itself_is_refused_and_touches_nothing(target, tmp_path):
    """The export writes confidence.json / calibration.json beside the graphs and a re-export removes
    them: into the checkpoint's own folder that would overwrite, then delete, the checkpoint's files."""
    ckpt = _checkpoint(target, tmp_path / "ckpt", "stacked")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    pt = from_pretrained(ckpt, target)
    with pytest.raises(ExportError, match="is the checkpoint folder itself"):
        export_onnx(pt, ckpt, checkpoint=ckpt)
    with pytest.raises(ExportError, match="is the checkpoint folder itself"):
        export_onnx(pt, tmp_path / "ckpt" / ".." / "ckpt", checkpoint=ckpt)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
