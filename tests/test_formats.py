"""Checkpoint formats: detection, reading, writing and conversion against the reference fixtures.

The oracle is the reference's own files: a DeepSpec checkpoint converted to speculators must have
exactly the bytes speculators wrote for the same tensors (and back), and each refusal names what
the output format cannot hold.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import reference_fixtures as rf
from dspark.cli import main as cli_main
from dspark.drafters import formats
from dspark.drafters.checkpoint import CheckpointError, from_pretrained, read_config
from dspark.protocols import TargetFeatures
from dspark.protocols.drafter import DraftContext
from dspark.types import SamplingParams

PAIRS = [("deepspec-dspark-vanilla", "speculators-dspark"), ("deepspec-dflash", "speculators-dflash"),
         ("deepspec-eagle3", "speculators-eagle3")]


@pytest.fixture(scope="module")
def target(one_thread):
    return rf.target()


VERIFIER = rf.ROOT / "target"  # DeepSpec block configs name no verifier; the speculators writer needs one


def _bytes(folder, name="model.safetensors"):
    return (folder / name).read_bytes()


@pytest.mark.parametrize("name,fmt", [("deepspec-dspark-gated", "deepspec"), ("deepspec-eagle3", "deepspec"),
                                      ("speculators-dspark", "speculators"), ("speculators-eagle3", "speculators")])
def test_detect(name, fmt):
    assert formats.detect(rf.folder(name)) == fmt


def test_unknown_folder_names_the_formats_tried(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(CheckpointError) as err:
        formats.detect(tmp_path)
    msg = str(err.value)
    for fmt in formats.FORMATS:
        assert fmt in msg
    assert "speculators_model_type" in msg and "target_layer_ids" in msg and "dflash_config" in msg


def test_the_facade_loads_a_shipped_drafter_by_name_and_names_them_when_missing(tmp_path):
    """`dspark.from_pretrained` takes a shipped drafter's name as well as a folder: the same weights
    as the folder itself; a name that is neither fails naming the shipped drafters."""
    import dspark
    from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint

    by_name = dspark.from_pretrained(DEFAULT_DRAFTER)
    by_path = from_pretrained(resolve_checkpoint(DEFAULT_DRAFTER))
    assert by_name.config == by_path.config
    a, b = by_name.state_dict(), by_path.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(CheckpointError, match=f"neither a checkpoint folder nor a shipped drafter .*{DEFAULT_DRAFTER}"):
        dspark.from_pretrained(tmp_path / "no-such-drafter")
    assert dspark.save_pretrained is not None and "from_pretrained" in dspark.__all__


def _assert_same_fields(mine, ref, keys):
    for key in keys:
        assert mine.get(key) == ref.get(key), key


def _convert_and_compare(src, to, reference, tmp_path, keys):
    """Convert fixture ``src`` to format ``to``: its weights must be the bytes of fixture
    ``reference``, its config equal on ``keys``; → (our config, the reference's)."""
    out = formats.convert(rf.folder(src), to, tmp_path / "out", verifier=VERIFIER if to == "speculators" else None)
    assert _bytes(out) == _bytes(rf.folder(reference))
    mine = json.loads((out / "config.json").read_text())
    ref = json.loads((rf.folder(reference) / "config.json").read_text())
    _assert_same_fields(mine, ref, keys)
    return mine, ref


@pytest.mark.parametrize("deepspec,speculators", PAIRS)
def test_deepspec_to_speculators_is_byte_identical(deepspec, speculators, tmp_path):
    mine, ref = _convert_and_compare(deepspec, "speculators", speculators, tmp_path, (
        "architectures", "speculators_model_type", "aux_hidden_state_layer_ids",
        "eagle_aux_hidden_state_layer_ids", "block_size", "mask_token_id", "sample_from_anchor",
        "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
        "draft_vocab_size", "norm_before_fc", "fc_norm", "norm_output", "norm_before_residual", "auto_map"))
    _assert_same_fields(mine["transformer_layer_config"], ref["transformer_layer_config"], (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "rms_norm_eps", "rope_parameters", "vocab_size", "model_type", "layer_types"))
    assert mine["speculators_config"]["proposal_methods"] == ref["speculators_config"]["proposal_methods"]


@pytest.mark.parametrize("deepspec,speculators", PAIRS)
def test_speculators_to_deepspec_is_byte_identical(deepspec, speculators, tmp_path):
    _convert_and_compare(speculators, "deepspec", deepspec, tmp_path, (
        "architectures", "target_layer_ids", "num_target_layers", "block_size", "mask_token_id",
        "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
        "ttt_length", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "rms_norm_eps", "rope_parameters", "vocab_size", "model_type"))


@pytest.mark.parametrize("name", ["deepspec-dspark-gated", "deepspec-dspark-rnn", "deepspec-dspark-vanilla",
                                  "deepspec-dflash"])
def test_round_trip_through_dspark_format_with_the_target(name, target, tmp_path):
    """DeepSpec → dspark (no target tensors stored) → DeepSpec (the target supplies them): same bytes."""
    mid = formats.convert(rf.folder(name), "dspark", tmp_path / "dspark")
    assert "embed_tokens.weight" not in load_file(str(mid / "model.safetensors"))
    assert read_config(mid).mask_token_id == rf.mask_token_id(name)
    back = formats.convert(mid, "deepspec", tmp_path / "back", target=target)
    assert _bytes(back) == _bytes(rf.folder(name))
    with pytest.raises(CheckpointError, match="embedding and LM head"):
        formats.convert(mid, "deepspec", tmp_path / "no-target")
    assert not (tmp_path / "no-target").exists()


@pytest.mark.parametrize("name", ["deepspec-dspark-gated", "deepspec-dspark-rnn"])
def test_gated_and_rnn_heads_are_refused_for_vllm(name, tmp_path):
    with pytest.raises(CheckpointError) as err:
        formats.convert(rf.folder(name), "speculators", tmp_path / "out")
    assert "vLLM serves only the vanilla head" in str(err.value) and "deepspec" in str(err.value)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_cli_convert_one_liner(tmp_path, capsys):
    rc = cli_main(["convert", "--drafter", str(rf.folder("deepspec-dspark-vanilla")), "--out", str(tmp_path / "out"), "--to", "speculators",
                   "--verifier", str(VERIFIER)])
    assert rc == 0 and "deepspec" in capsys.readouterr().out
    assert _bytes(tmp_path / "out") == _bytes(rf.folder("speculators-dspark"))
    rc = cli_main(["convert", "--drafter", str(rf.folder("deepspec-dspark-vanilla")), "--out", str(tmp_path / "out"), "--to", "speculators",
                   "--verifier", str(VERIFIER)])
    assert rc == 2 and "exists" in capsys.readouterr().err  # never clobbered without --overwrite


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    import safetensors.torch as st

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        formats.convert(rf.folder("deepspec-dflash"), "speculators", tmp_path / "out", verifier=VERIFIER)
    assert list(tmp_path.iterdir()) == []


def test_weight_shape_mismatch_names_key_and_shapes(tmp_path, target):
    shutil.copytree(rf.folder("deepspec-dflash"), tmp_path / "ck")
    state = load_file(str(tmp_path / "ck" / "model.safetensors"))
    d, width = rf.hidden_size(), rf.feature_width("deepspec-dflash")  # fc: features → d
    assert state["fc.weight"].shape == (d, width)
    state["fc.weight"] = state["fc.weight"][:, : width - 1].contiguous()
    save_file(state, str(tmp_path / "ck" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        from_pretrained(tmp_path / "ck", target)
    assert "fc.weight" in str(err.value) and f"({d}, {width - 1})" in str(err.value) and f"({d}, {width})" in str(err.value)


def test_checkpoint_for_another_verifier_names_both(tmp_path):
    """Same dimensions, other weights: the embedding copy in the checkpoint gives it away."""
    from transformers import AutoModelForCausalLM

    from dspark.targets import HFTarget

    model = AutoModelForCausalLM.from_config(rf.target_model().config).eval()
    other = HFTarget(model)
    other.name = "another-qwen3"
    with pytest.raises(CheckpointError) as err:
        from_pretrained(rf.folder("deepspec-dspark-vanilla"), other)
    assert "another-qwen3" in str(err.value) and "another verifier" in str(err.value)


def test_missing_field_is_named(tmp_path):
    shutil.copytree(rf.folder("deepspec-dspark-vanilla"), tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    del cfg["mask_token_id"]
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        formats.read(tmp_path / "ck")


def _zlab_folder(tmp_path, block_size):
    """A z-lab DFlash folder (dflash_config, no anchor drafting) holding the deepspec-dflash tensors."""
    src = rf.folder("deepspec-dflash")
    cfg = json.loads((src / "config.json").read_text())
    ids, mask = cfg.pop("target_layer_ids"), cfg.pop("mask_token_id")
    for k in ("markov_rank", "enable_confidence_head", "num_anchors"):
        cfg.pop(k, None)
    cfg.update(architectures=["DFlashDraftModel"], block_size=block_size,
               dflash_config={"target_layer_ids": ids, "mask_token_id": mask})
    (tmp_path / "zlab").mkdir()
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "model.safetensors", tmp_path / "zlab" / "model.safetensors")
    return tmp_path / "zlab"


def test_zlab_dflash_drafts_from_the_mask_slots_only(tmp_path, target):
    """z-lab's block of B is [anchor, MASK × (B−1)] and its anchor row predicts nothing: its γ = B − 1
    drafts are rows 1..B−1 of the same forward that DeepSpec's DFlash (rows 0..B−1) runs."""
    gamma = rf.block_size("deepspec-dflash")
    B = gamma + 1  # z-lab's block of B gives the γ drafts of DeepSpec's block of γ
    zlab = from_pretrained(_zlab_folder(tmp_path, B), target)
    assert formats.detect(tmp_path / "zlab") == "zlab-dflash"
    assert zlab.gamma == gamma and not zlab.config.sample_from_anchor
    t, _ = rf.cases("deepspec-dflash")
    ids, feats = t["round_1/known_ids"], t["round_1/target_hidden_states"]
    block = zlab.draft(DraftContext(["r"], [ids], [SamplingParams.greedy()], features=TargetFeatures([feats])))
    ref_cfg = json.loads((rf.folder("deepspec-dflash") / "config.json").read_text())
    ref_cfg["block_size"] = B
    (tmp_path / "ds_block_B").mkdir()
    (tmp_path / "ds_block_B" / "config.json").write_text(json.dumps(ref_cfg))
    shutil.copy(rf.folder("deepspec-dflash") / "model.safetensors", tmp_path / "ds_block_B" / "model.safetensors")
    dsB = from_pretrained(tmp_path / "ds_block_B", target)
    rows = dsB.draft(DraftContext(["r"], [ids], [SamplingParams.greedy()], features=TargetFeatures([feats])))
    torch.testing.assert_close(block.draft_logits[0], rows.draft_logits[0, 1:], atol=1e-5, rtol=0)
    assert block.tokens[0].tolist() == rows.tokens[0, 1:].tolist()
    # written as speculators it keeps sample_from_anchor false and block_size B
    out = formats.convert(tmp_path / "zlab", "speculators", tmp_path / "spec", verifier=VERIFIER)
    spec = json.loads((out / "config.json").read_text())
    assert spec["sample_from_anchor"] is False and spec["block_size"] == B
    with pytest.raises(CheckpointError, match="z-lab"):
        formats.convert(tmp_path / "zlab", "deepspec", tmp_path / "ds")


@pytest.mark.parametrize("name", ["deepspec-dspark-gated", "speculators-dflash", "deepspec-eagle3"])
def test_export_reads_reference_checkpoints(name, tmp_path, capsys):
    """`python -m dspark.export` takes a reference folder like any other and validates against it."""
    from dspark.export.cli import main as export_main

    rc = export_main(["--drafter", str(rf.folder(name)), "--out", str(tmp_path / "onnx"), "--target", str(rf.ROOT / "target"),
                      "--validate", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy drafts identical" in out and "— ok" in out


def test_unknown_verifier_layer_count_is_not_guessed(tmp_path, target):
    """A speculators folder whose verifier config is not at hand does not record num_target_layers:
    writing DeepSpec (which needs it) is refused unless the target is given."""
    shutil.copytree(rf.folder("speculators-dspark"), tmp_path / "spec")  # no sibling 'target' folder here
    with pytest.raises(CheckpointError, match="num_target_layers"):
        formats.convert(tmp_path / "spec", "deepspec", tmp_path / "out")
    out = formats.convert(tmp_path / "spec", "deepspec", tmp_path / "out", target=target)
    assert json.loads((out / "config.json").read_text())["num_target_layers"] == rf.num_target_layers()


def _user_files(root):
    """A user's folder: a checkpoint copy, notes and data — nothing dspark wrote."""
    shutil.copytree(rf.folder("deepspec-dspark-vanilla"), root / "ckpt")
    (root / "notes.txt").write_text("mine")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("{}\n")
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("where", ["parent-of-src", "src", "cwd", "user-folder"])
def test_convert_overwrite_never_deletes_what_dspark_did_not_write(where, tmp_path, monkeypatch, capsys):
    """--overwrite replaces only a folder dspark wrote; never the source, an ancestor of it, the
    current folder or a user's folder. Each refusal is one sentence, exit 2, nothing touched."""
    root = tmp_path / "work"
    root.mkdir()
    before = _user_files(root)
    monkeypatch.chdir(root)
    out = {"parent-of-src": str(root), "src": str(root / "ckpt"), "cwd": ".", "user-folder": str(root / "data")}[where]
    rc = cli_main(["convert", "--drafter", str(root / "ckpt"), "--out", out, "--to", "speculators", "--overwrite"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and ("input" in err or "not written by dspark" in err), err
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    with pytest.raises(CheckpointError):
        formats.convert(root / "ckpt", "speculators", out, overwrite=True)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before


def test_convert_overwrite_replaces_a_folder_dspark_wrote(tmp_path):
    out = tmp_path / "out"
    formats.convert(rf.folder("deepspec-dflash"), "speculators", out, verifier=VERIFIER)
    assert (out / ".dspark-output").is_file()
    formats.convert(rf.folder("deepspec-dspark-vanilla"), "speculators", out, overwrite=True, verifier=VERIFIER)
    assert _bytes(out) == _bytes(rf.folder("speculators-dspark"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left beside it


def _edited(tmp_path, name, *, config=None, weights=None):
    folder = tmp_path / "edited"
    shutil.copytree(rf.folder(name), folder)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if weights:
        state = load_file(str(folder / "model.safetensors"))
        weights(state)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _first_layer_key(state):
    return next(k for k in sorted(state) if k.endswith(".weight") and "layers" in k)


@pytest.mark.parametrize("case, match", [
    ("missing", "is missing for this"),
    ("extra", "is not a weight of this"),
    ("int32", "holds int32, not floats"),
    ("huge", "needs"),
])
def test_convert_refuses_a_checkpoint_that_contradicts_its_config(tmp_path, case, match):
    """Checked tensor by tensor against the config before anything is written; a hostile size in
    config.json is checked on the meta device (nothing allocated), so it fails at once."""
    def missing(st):
        st.pop(_first_layer_key(st))

    def extra(st):
        st["model.stray.weight"] = torch.zeros(2, 2)

    def int32(st):
        k = _first_layer_key(st)
        st[k] = st[k].to(torch.int32)

    def huge(cfg):
        cfg["intermediate_size"] = 10**9

    edits = {"missing": dict(weights=missing), "extra": dict(weights=extra), "int32": dict(weights=int32),
             "huge": dict(config=huge)}
    src = _edited(tmp_path, "deepspec-dflash", **edits[case])
    with pytest.raises(CheckpointError, match=match):  # a 10⁹ size allocated would take minutes and GBs
        formats.convert(src, "speculators", tmp_path / "out", verifier=VERIFIER)
    assert not (tmp_path / "out").exists()
