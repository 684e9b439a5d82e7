"""Adding a drafter kind is one folder plus its hook lines: the test plugin ``tests/kind_plugin/``
(kind ``scaled-dflash``: DFlash's backbone whose logits a learned factor scales, with its own
module, graphs and tensor-name map) is registered through the plugin manager's hooks, as
dspark's built-in kinds are, and then builds, drafts a round on a tiny target, stays lossless in
the engine, trains, and saves and reloads its checkpoint."""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark import plugins
from dspark.drafters.checkpoint import from_pretrained, save_pretrained
from dspark.drafters.formats import FormatError, read, write
from dspark.protocols import DraftContext, TargetFeatures
from dspark.training.trainer import TrainConfig, TrainData, Trainer
from dspark.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def scaled_kind():
    import kind_plugin

    plugins.register(kind_plugin, name="kind-plugin")
    yield kind_plugin
    plugins.unregister(kind_plugin)


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dspark.targets import HFTarget

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    return HFTarget(AutoModelForCausalLM.from_config(cfg).eval())


def _round(drafter, target, prompt):
    """One drafting round on ``prompt``, the target's features computed from its hidden states."""
    with torch.no_grad():
        hs = target.model(prompt[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0, : prompt.numel() - 1] for i in drafter.target_layer_ids], dim=-1)
    drafter.release("r0")
    return drafter.draft(DraftContext(["r0"], [prompt], [SamplingParams()], features=TargetFeatures([feats])))


def test_a_plugin_kind_folder_builds_drafts_trains_saves_and_reloads(scaled_kind, target, tmp_path):
    from kind_plugin.model import ScaledBlockDrafter

    assert "scaled-dflash" in dspark.plugins.registry()["drafter_kinds"]
    drafter = dspark.get_drafter("scaled-dflash", target=target, gamma=3)
    assert isinstance(drafter, ScaledBlockDrafter)
    assert drafter.config.num_layers == 1 and drafter.config.mask_token_id == 63  # the kind's defaults
    with torch.no_grad():
        drafter.logit_scale.fill_(0.5)

    prompt = torch.tensor([1, 5, 9, 2, 7, 11, 3])
    block = _round(drafter, target, prompt)
    assert block.tokens.shape == (1, 3) and block.draft_logits.shape == (1, 3, 64)
    with torch.no_grad():  # the kind's own graph scales the backbone's logits
        drafter.logit_scale.fill_(1.0)
    unscaled = _round(drafter, target, prompt)
    torch.testing.assert_close(block.draft_logits.log_softmax(-1), (0.5 * unscaled.draft_logits).log_softmax(-1))
    with torch.no_grad():
        drafter.logit_scale.fill_(0.5)

    plain = target.model.generate(prompt[None], max_new_tokens=10, do_sample=False)[0, prompt.numel():].tolist()
    out = dspark.Engine(target, drafter, scheduler="full").generate([prompt], max_new_tokens=10, progress=False)
    assert out[0].output_ids == plain

    # its checkpoint: saved, read back through its tensor-name map, reloaded bound to the target
    folder = save_pretrained(drafter, tmp_path / "ckpt")
    portable = read(folder)
    assert "lm_temperature" in portable.weights and "fc.weight" in portable.weights
    again = dspark.get_drafter("scaled-dflash", checkpoint=str(folder), target=target)
    assert isinstance(again, ScaledBlockDrafter) and float(again.logit_scale.detach()) == 0.5
    torch.testing.assert_close(_round(again, target, prompt).draft_logits, block.draft_logits)
    assert torch.equal(from_pretrained(folder, target).state_dict()["logit_scale"], torch.tensor(0.5))
    with pytest.raises(FormatError, match="a scaled-dflash drafter, a kind no reference format holds"):
        write(portable, "speculators", tmp_path / "spec")

    # it trains with the recipe its kind object names (the module's refine applies the scale)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (12,), generator=g).tolist() for _ in range(4)]
    cfg = TrainConfig.for_kind("scaled-dflash", steps=2, seqs_per_step=2, anchors_per_seq=2)
    assert (cfg.lambda_ce, cfg.lambda_l1) == (1.0, 0.0)
    log = Trainer(again, TrainData(seqs, [4] * 4, model=target.model), cfg, tmp_path / "train", progress=False).fit()
    assert len(log) == 2 and all(r["loss"] > 0 for r in log)
    assert again.logit_scale.grad is not None and float(again.logit_scale.detach()) != 0.5
