"""Reduced-precision export on a CPU box: RMSNorm's fp32 mean of squares, the fp16/bf16 ONNX
variants a strongly typed TensorRT build parses (their norms stay fp32 through explicit Casts),
an fp16 run with real-sized features (|x| = 2.5e4) that stays finite with the fp32 norm and
overflows without it, validation on real target features, and TF32 kept off during fp32 parity.

The fp16 executions use ``onnx.reference.ReferenceEvaluator`` (numpy, every op in the graph's
own dtype): ONNX Runtime's CPU provider is not a faithful fp16 machine — it runs fp16 ops that
lack CPU kernels (Pow, ReduceMean, …) in fp32, which hides exactly the overflow in question.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnx", reason="export tests need onnx: pip install 'dspark[onnx]'")
pytest.importorskip("onnxruntime", reason="export tests need onnxruntime: pip install 'dspark[onnx]'")

import onnx  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import dspark  # noqa: E402
from dspark.drafters import layers  # noqa: E402
from dspark.export import OrtDrafter, compare_drafters, export_onnx  # noqa: E402
from dspark.export.manifest import graph_entries, read_manifest  # noqa: E402
from dspark.export.runtime import ExportedDrafter  # noqa: E402
from dspark.export.validate import OUTLIER_MAGNITUDE, no_tf32  # noqa: E402
from dspark.targets import HFTarget  # noqa: E402
from helpers import save_tiny_target, tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V = 64
FP16_TOL = 5e-2  # relative to max(1, max |logit|), as --validate uses for fp16 TensorRT engines


def _drafter(target, **kw):
    torch.manual_seed(1)
    cfg = dict(kind="dspark", num_layers=2, gamma=4, rank=16, head="gated-markov") | kw
    d = dspark.get_drafter(cfg.pop("kind"), target=target, **cfg)
    for p in d.parameters():  # zero-initialised W_up would hide the head: randomise
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.2)
    return d


@pytest.fixture(scope="module")
def target():
    return HFTarget(tiny_causal_lm("llama", vocab_size=V, max_positions=96, init_range=0.3))


def _naive_rmsnorm(self, x):  # what RMSNorm must not do: square in the input's dtype
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.fixture(scope="module")
def fp16_exports(target, tmp_path_factory):
    """(drafter, folder with fp32 + fp16 + bf16 graphs, folder whose fp16 graphs square in fp16)."""
    d = _drafter(target)
    good = tmp_path_factory.mktemp("fp16-good")
    export_onnx(d, good, precisions=["fp16", "bf16"])
    naive = tmp_path_factory.mktemp("fp16-naive")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layers.RMSNorm, "forward", _naive_rmsnorm)
        export_onnx(d, naive, precisions=["fp16"])
    return d, good, naive


class ReferenceRunner:
    """A GraphRunner over onnx.reference: every op computed in its graph dtype (fp16 stays fp16)."""

    device = torch.device("cpu")
    limits: dict = {}

    def __init__(self, root: Path, precision: str) -> None:
        manifest = read_manifest(root)
        entries = graph_entries(manifest, precision)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.sessions = {g: ReferenceEvaluator(str(root / e["file"])) for g, e in entries.items()}
        self.io = {g: ([i["name"] for i in e["inputs"]], [o["name"] for o in e["outputs"]])
                   for g, e in entries.items()}
        self.manifest = manifest

    def run(self, graph, inputs):
        names, outs = self.io[graph]
        feeds = {k: inputs[k].detach().cpu().numpy() for k in names}
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            res = self.sessions[graph].run(None, feeds)
        return {k: torch.from_numpy(np.asarray(v)) for k, v in zip(outs, res)}


def _reference_drafter(root: Path, precision: str) -> ExportedDrafter:
    runner = ReferenceRunner(root, precision)
    return ExportedDrafter(runner.manifest, runner, root)


# --------------------------------------------------------------------------------------------
# RMSNorm and the graphs' types
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_squares_in_fp32_whatever_the_input_dtype(dtype):
    """|x| = 2.5e4: x² = 6.25e8 overflows fp16 (max 65504); RMSNorm stays finite and matches fp32."""
    torch.manual_seed(0)
    norm = layers.RMSNorm(64).to(dtype)
    x = torch.randn(3, 64)
    x[:, 5] = OUTLIER_MAGNITUDE
    ref = layers.RMSNorm(64)(x)
    y = norm(x.to(dtype))
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2)
    if dtype == torch.float16:
        assert torch.isinf(x.to(dtype).pow(2).mean(-1)).all()  # the naive mean of squares overflows
        assert not _naive_rmsnorm(norm, x.to(dtype)).any()  # and the output collapses to zero


def _types(model):
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


@pytest.mark.parametrize("precision, low", [("fp16", onnx.TensorProto.FLOAT16), ("bf16", onnx.TensorProto.BFLOAT16)])
def test_reduced_precision_graphs_keep_norms_and_softmax_in_fp32(fp16_exports, precision, low):
    """What a strongly typed TensorRT network gets: weights and matmuls in fp16/bf16, every
    RMSNorm's Pow / ReduceMean / Sqrt and every Softmax fed fp32 (explicit Casts), fp32 I/O."""
    _, root, _ = fp16_exports
    m = read_manifest(root)
    assert set(m["graph_variants"]) == {"fp16", "bf16"}
    for name, entry in m["graph_variants"][precision].items():
        assert entry["file"] == f"{name}.{precision}.onnx"
        fp32 = m["graphs"][name]
        assert [(x["name"], x["dtype"], x["shape"]) for x in entry["inputs"]] == \
               [(x["name"], x["dtype"], x["shape"]) for x in fp32["inputs"]]  # same I/O as fp32
        assert [(x["name"], x["dtype"]) for x in entry["outputs"]] == [(x["name"], x["dtype"]) for x in fp32["outputs"]]
        model = onnx.load(str(root / entry["file"]))
        types = _types(model)
        big = [t for t in model.graph.initializer if np.prod(t.dims) >= 256]
        low_bytes = sum(np.prod(t.dims) for t in big if t.data_type == low)
        # the weights are in the low precision (torch's exporter keeps o_proj, fed by its fp32
        # attention, in fp32: a few d×d matrices); the target's LM head always
        assert big and low_bytes >= 0.75 * sum(np.prod(t.dims) for t in big)
        assert all(t.data_type == low for t in big if "lm_head" in t.name or "fuse" in t.name)
        matmuls = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
        assert any(types.get(n.input[1]) == low for n in matmuls)
        scopes = {n.name.rsplit("/", 1)[0] for n in model.graph.node if n.name.rsplit("/", 1)[0].endswith("norm")}
        assert len(scopes) == len(fp32["norm_scopes"])  # same RMSNorms as the fp32 graph
        for n in model.graph.node:
            if n.name.rsplit("/", 1)[0] in scopes and n.op_type in ("Pow", "ReduceMean", "Sqrt"):
                assert types[n.input[0]] == onnx.TensorProto.FLOAT, n.name
            if n.op_type == "Softmax":
                assert types[n.input[0]] == onnx.TensorProto.FLOAT, n.name


def test_manifest_lists_norm_scopes_and_a_reexport_removes_stale_variants(target, tmp_path):
    d = _drafter(target)
    m = export_onnx(d, tmp_path, precisions=["fp16"])
    assert m["graphs"]["backbone"]["norm_scopes"] == [
        "/layers.0/input_norm/", "/layers.0/k_norm/", "/layers.0/post_norm/", "/layers.0/q_norm/",
        "/layers.1/input_norm/", "/layers.1/k_norm/", "/layers.1/post_norm/", "/layers.1/q_norm/", "/norm/"]
    # the context graph reaches k_norm through layer.context_kv (no layer forward): one scope for both
    assert m["graphs"]["context"]["norm_scopes"] == ["/fuse_norm/", "/k_norm/"]
    assert (tmp_path / "backbone.fp16.onnx").is_file()
    m = export_onnx(d, tmp_path)
    assert "graph_variants" not in m and not list(tmp_path.glob("*.fp16.onnx"))
    with pytest.raises(dspark.export.ExportError, match="this export has no fp16 graphs"):
        OrtDrafter.from_dir(tmp_path, precision="fp16")


# --------------------------------------------------------------------------------------------
# fp16 with real-sized features: finite with the fp32 norm, overflowing without it
# --------------------------------------------------------------------------------------------


def test_fp16_context_graph_with_large_features_overflows_only_without_the_fp32_norm(fp16_exports):
    """The exported fp16 context graph (fusion + RMSNorm + K/V) run in fp16 on features with a
    |x| = 2.5e4 channel: the mean of squares is finite and K/V match fp32 with the fp32 norm; with
    a norm that squares in fp16 it is inf and K/V collapse to zero."""
    _, good, naive = fp16_exports
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((5, 96)).astype(np.float32)
    feats[:, 7] = OUTLIER_MAGNITUDE
    feeds = {"features": feats, "positions": np.arange(5)}

    def run(path, names=None):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return ReferenceEvaluator(str(path)).run(names, feeds)

    ref_k, _ = run(good / "context.onnx")
    mean_sq = "/graph/fuse_norm/ReduceMean_output_0"
    k, v, ms = run(good / "context.fp16.onnx", ["ctx_k", "ctx_v", mean_sq])
    assert np.isfinite(ms).all() and ms.dtype == np.float32 and np.isfinite(k).all() and np.isfinite(v).all()
    assert np.abs(k - ref_k).max() <= 2e-2 * max(1.0, np.abs(ref_k).max())
    k_bad, ms_bad = run(naive / "context.fp16.onnx", ["ctx_k", mean_sq])
    assert ms_bad.dtype == np.float16 and np.isinf(ms_bad).all()  # x² overflowed
    assert not k_bad.any() and np.abs(ref_k).max() > 0.5  # the drafter's context is gone


def test_fp16_drafter_with_large_features_matches_pytorch_only_with_fp32_norms(fp16_exports):
    """Whole drafter, fp16 graphs executed in fp16, validation's synthetic features (|x| = 2.5e4
    outliers): the fp32-norm graphs pass fp16 validation, the fp16-norm graphs fail it."""
    d, good, naive = fp16_exports
    ok = compare_drafters(d, _reference_drafter(good, "fp16"))
    assert ok.max_abs_feature == OUTLIER_MAGNITUDE and ok.features == "randn"
    assert ok.exported_finite and ok.greedy_tokens_equal
    assert ok.max_abs_logits <= FP16_TOL * max(1.0, ok.logit_scale)
    bad = compare_drafters(d, _reference_drafter(naive, "fp16"))
    assert not bad.passed(FP16_TOL * max(1.0, bad.logit_scale))
    assert not bad.greedy_tokens_equal and bad.max_abs_logits > 10 * ok.max_abs_logits
    # plain randn (|x| < 6, what --validate used to feed) does not catch it
    small = compare_drafters(d, _reference_drafter(naive, "fp16"), outlier_magnitude=0)
    assert small.max_abs_feature < 10 and small.max_abs_logits <= FP16_TOL * max(1.0, small.logit_scale)


def test_ort_runs_the_fp16_graphs(fp16_exports):
    d, good, _ = fp16_exports
    report = compare_drafters(d, OrtDrafter.from_dir(good, threads=1, precision="fp16"))
    assert report.exported_finite and report.greedy_tokens_equal
    assert report.max_abs_logits <= FP16_TOL * max(1.0, report.logit_scale)


# --------------------------------------------------------------------------------------------
# Validation: real target features, TF32 off
# --------------------------------------------------------------------------------------------


def test_validation_uses_the_targets_own_features(tmp_path):
    """With a target, compare_drafters feeds the target's own hidden states (natural prompts through
    its tokenizer when it has one; one prefill, then a verify of the committed tokens each round)
    and leaves the target as it found it: over the three rounds each request gets exactly the
    features a full forward of its final sequence gives."""
    from transformers import AutoTokenizer

    from dspark.export.validate import _FALLBACK_PROMPTS, natural_prompts

    model = tiny_causal_lm("llama", vocab_size=V, max_positions=96, init_range=0.3)
    folder = save_tiny_target(tmp_path / "tiny", model)
    tgt = HFTarget(model, AutoTokenizer.from_pretrained(folder), capture_layers=(0,))
    d = _drafter(tgt)
    export_onnx(d, tmp_path / "o")
    seen = []
    draft = d.draft

    def spy(ctx):
        seen.append(([t.clone() for t in ctx.token_ids], [f.clone() for f in ctx.features.hidden]))
        return draft(ctx)

    d.draft = spy
    report = compare_drafters(d, OrtDrafter.from_dir(tmp_path / "o", threads=1), target=tgt)
    assert report.features == "target" and report.requests == 4  # 3 natural prompts + a one-token prompt
    assert report.greedy_tokens_equal and report.max_abs_logits <= 1e-4
    assert tgt.capture_layers == (0,) and not tgt.request_ids  # restored, nothing left behind
    assert not set(natural_prompts(3)) & set(_FALLBACK_PROMPTS)  # the shipped eval set was found
    final_tokens = seen[-1][0]
    assert [t.numel() for t in final_tokens][0] > 1 and final_tokens[2].numel() > 3
    for i, toks in enumerate(final_tokens):
        feats = torch.cat([rnd[1][i] for rnd in seen])  # what the drafter got over the rounds
        assert feats.shape[0] == toks.numel() - 1
        if feats.shape[0]:
            with torch.inference_mode():
                hs = model(toks[None, :-1], output_hidden_states=True).hidden_states
            want = torch.cat([hs[k + 1][0] for k in d.target_layer_ids], dim=-1)
            assert torch.allclose(feats, want, atol=1e-4), i


def test_no_tf32_turns_tf32_off_and_restores_it(target):
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        with no_tf32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        # compare_drafters drafts with TF32 off and restores it, also when drafting fails
        d = _drafter(target)
        seen = []
        draft = d.draft

        def spy(ctx):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            return draft(ctx)

        d.draft = spy
        compare_drafters(d, _drafter(target))
        assert seen and set(seen) == {(False, False)}
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32

        def broken(ctx):
            raise RuntimeError("boom")

        d.draft = broken
        with pytest.raises(RuntimeError, match="boom"):
            compare_drafters(d, _drafter(target))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def test_cli_validate_reports_target_features(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from dspark.drafters.checkpoint import save_pretrained
    from dspark.export.cli import main

    folder = save_tiny_target(tmp_path / "tiny", tiny_causal_lm("llama", vocab_size=V, max_positions=96,
                                                                init_range=0.3))
    tgt = HFTarget(AutoModelForCausalLM.from_pretrained(folder).eval())
    save_pretrained(_drafter(tgt), tmp_path / "ckpt")
    capsys.readouterr()
    rc = main(["--drafter", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o"), "--target", str(folder), "--validate",
               "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("validate onnxruntime"))
    assert "target features up to |x|" in line and line.endswith("— ok")
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["dtype"] == "float32"
