"""Neural drafters: shapes, incremental context caching, batch invariance, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

import dspark
from dspark.drafters.checkpoint import (
    CheckpointError,
    from_pretrained,
    save_pretrained,
)
from dspark.drafters.config import DrafterConfig, default_layer_ids
from dspark.drafters.neural import build_drafter
from dspark.protocols import DraftContext, TargetFeatures
from dspark.types import SamplingParams
from helpers import tiny_causal_lm, tiny_config

KINDS = {
    "dspark-gated": dict(kind="dspark", num_layers=2, gamma=4, rank=16, head="gated-markov"),
    "dspark-vanilla": dict(kind="dspark", num_layers=2, gamma=4, rank=16, head="vanilla-markov"),
    "dspark-rnn": dict(kind="dspark", num_layers=2, gamma=4, rank=16, head="rnn"),
    "dflash": dict(kind="dflash", num_layers=2, gamma=4),
    "eagle3": dict(kind="eagle3", gamma=4),
}


pytestmark = pytest.mark.usefixtures("one_thread")

class FakeTarget:
    """Just enough of a target for binding: an HF model and its sizes."""

    def __init__(self, arch: str = "llama", vocab: int = 64, hidden: int = 32):
        self.model = tiny_causal_lm(arch, vocab_size=vocab, hidden_size=hidden, init_range=0.02, keep_eos=True)
        self.config = self.model.config
        self.name, self.vocab_size, self.hidden_size, self.num_layers = arch, vocab, hidden, 4

    def features(self, ids: torch.Tensor, layer_ids, start: int, stop: int) -> torch.Tensor:
        with torch.no_grad():
            hs = self.model(ids[None], output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1][0, start:stop] for i in layer_ids], dim=-1)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return FakeTarget(request.param)


def make(target, name, seed=0):
    torch.manual_seed(seed)
    cfg = dict(KINDS[name])
    kind = cfg.pop("kind")
    drafter = dspark.get_drafter(kind, target=target, **cfg)
    for p in drafter.parameters():  # zero-initialised W_up would hide the head: randomise
        torch.nn.init.normal_(p, std=0.1) if p.ndim > 1 else None
    return drafter


def ctx(target, drafter, prompts, seen, sampling=None, gens=None):
    feats = [target.features(p, drafter.target_layer_ids, s, p.numel() - 1) for p, s in zip(prompts, seen)]
    rids = [f"r{i}" for i in range(len(prompts))]
    sampling = sampling or [SamplingParams()] * len(prompts)
    return DraftContext(rids, prompts, sampling, gens, features=TargetFeatures(feats))


@pytest.mark.parametrize("name", sorted(KINDS))
def test_draft_shapes_and_confidence(target, name):
    d = make(target, name)
    prompts = [torch.randint(0, 64, (n,)) for n in (9, 3, 1)]
    blk = d.draft(ctx(target, d, prompts, [0, 0, 0]))
    assert blk.tokens.shape == (3, 4) and blk.q.shape == (3, 4, 64)
    torch.testing.assert_close(blk.q.sum(-1), torch.ones(3, 4))
    # greedy drafts are the argmax of the (corrected) logits they were drawn from
    assert torch.equal(blk.tokens, blk.draft_logits.argmax(-1))
    assert (blk.confidence_logits is not None) == name.startswith("dspark")


@pytest.mark.parametrize("name", sorted(KINDS))
def test_incremental_context_equals_fresh_drafter(target, name):
    """Two rounds with cached context K/V give what a fresh drafter computes from scratch."""
    d = make(target, name)
    p0 = torch.randint(0, 64, (7,))
    blk = d.draft(ctx(target, d, [p0], [0]))
    p1 = torch.cat([p0, blk.tokens[0, :2], torch.tensor([5])])  # 2 accepted + a recovered token
    c1 = ctx(target, d, [p1], [p0.numel() - 1])
    # the engine also says where the new features start: right after the context, so no restart
    c1 = DraftContext(c1.request_ids, c1.token_ids, c1.sampling, features=TargetFeatures(c1.features.hidden, [p0.numel() - 1]))
    second = d.draft(c1)
    fresh = make(target, name)
    again = fresh.draft(ctx(target, fresh, [p1], [0]))
    torch.testing.assert_close(second.draft_logits, again.draft_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(second.tokens, again.tokens)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_feature_gap_restarts_the_context_as_a_fresh_drafter_on_the_suffix(target, name):
    """After a gap (features resume at position s, `TargetFeatures.start`), the drafter attends to the
    context from s on. Its layers see positions only through RoPE, so this equals a fresh drafter
    given the suffix from s as a sequence of its own (the same feature vectors). With no features
    at all (start = the anchor) it equals a fresh drafter on the anchor alone."""
    g = torch.Generator().manual_seed(3)
    p0 = torch.randint(0, 64, (7,), generator=g)
    p1 = torch.cat([p0, torch.randint(0, 64, (8,), generator=g)])  # 15 tokens, anchor at 14
    d = make(target, name)
    d.draft(ctx(target, d, [p0], [0]))  # context 0..5
    s = 10
    f = target.features(p1, d.target_layer_ids, s, p1.numel() - 1)  # positions 10..13
    after_gap = d.draft(DraftContext(["r0"], [p1], [SamplingParams()], features=TargetFeatures([f], [s])))
    fresh = make(target, name)
    suffix = fresh.draft(DraftContext(["r0"], [p1[s:]], [SamplingParams()], features=TargetFeatures([f])))
    torch.testing.assert_close(after_gap.draft_logits, suffix.draft_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(after_gap.tokens, suffix.tokens)
    # overlapping features are refused; an empty restart at the anchor drafts from the anchor alone
    p2 = torch.cat([p1, torch.tensor([3, 9])])
    with pytest.raises(ValueError, match="already holds context"):
        d.draft(DraftContext(["r0"], [p2], [SamplingParams()],
                             features=TargetFeatures([target.features(p2, d.target_layer_ids, 12, 16)], [12])))
    empty = torch.zeros(0, f.shape[1])
    alone = d.draft(DraftContext(["r0"], [p2], [SamplingParams()], features=TargetFeatures([empty], [16])))
    fresh = make(target, name)
    one = fresh.draft(DraftContext(["r0"], [p2[16:]], [SamplingParams()], features=TargetFeatures([empty])))
    torch.testing.assert_close(alone.draft_logits, one.draft_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_batch_invariance(target, name):
    """Padding requests of different lengths together changes nothing per request."""
    g = torch.Generator().manual_seed(2)  # not the global RNG: its state here depends on the tests run before
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (12, 2, 5)]
    d = make(target, name)
    together = d.draft(ctx(target, d, prompts, [0, 0, 0]))
    for i, p in enumerate(prompts):
        alone = make(target, name)
        one = alone.draft(ctx(target, alone, [p], [0]))
        torch.testing.assert_close(together.draft_logits[i], one.draft_logits[0], atol=1e-5, rtol=1e-5)


def test_sampled_drafts_use_the_request_generator(target):
    d = make(target, "dspark-gated")
    prompts = [torch.randint(0, 64, (6,))]
    s = [SamplingParams(temperature=1.0)]
    a = d.draft(ctx(target, d, prompts, [0], s, [torch.Generator().manual_seed(3)]))
    d.release("r0")
    b = d.draft(ctx(target, d, prompts, [0], s, [torch.Generator().manual_seed(3)]))
    assert torch.equal(a.tokens, b.tokens)


def test_missing_or_wrong_features_are_clear_errors(target):
    d = make(target, "dflash")
    p = torch.randint(0, 64, (5,))
    with pytest.raises(ValueError, match="features=TargetFeatures\\(hidden="):
        d.draft(DraftContext(["r"], [p], [SamplingParams()]))
    with pytest.raises(ValueError, match="features must be"):
        d.draft(DraftContext(["r"], [p], [SamplingParams()], features=TargetFeatures([torch.zeros(4, 7)])))
    with pytest.raises(ValueError, match="pass the target features of every committed token"):
        d.draft(DraftContext(["r"], [p], [SamplingParams()], features=TargetFeatures([torch.zeros(2, 32 * len(d.target_layer_ids))])))


def test_config_validation_and_defaults():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    cfg = tiny_config("qwen3", vocab_size=64)
    with pytest.raises(ValueError, match="layer ids \\[7\\] outside"):
        DrafterConfig.for_target(cfg, "dflash", layer_ids=(1, 7))
    with pytest.raises(ValueError, match="no sequential head"):
        DrafterConfig.for_target(cfg, "dflash", head="rnn")
    with pytest.raises(ValueError, match="exactly 3"):
        DrafterConfig.for_target(cfg, "eagle3-fused", layer_ids=(0, 1))
    with pytest.raises(ValueError, match="exactly one draft layer"):
        DrafterConfig.for_target(cfg, "eagle3", num_layers=2)
    assert DrafterConfig.for_target(cfg, "eagle3", layer_ids=(0, 1)).target_layer_ids == (0, 1)  # any m >= 1
    for kind in ("eagle3", "dspark", "dflash"):  # refused at construction, not when an Engine is built
        with pytest.raises(ValueError, match=r"target_layer_ids \[1, 1\] name a layer twice"):
            DrafterConfig.for_target(cfg, kind, layer_ids=(1, 1))
    c = DrafterConfig.for_target(cfg, "dspark", rank=8)
    assert DrafterConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("name", sorted(KINDS))
def test_save_and_load_round_trip(target, name, tmp_path):
    d = make(target, name)
    save_pretrained(d, tmp_path / "ckpt")
    loaded = dspark.get_drafter(d.config.kind, target=target, checkpoint=tmp_path / "ckpt")
    prompts = [torch.randint(0, 64, (6,))]
    torch.testing.assert_close(d.draft(ctx(target, d, prompts, [0])).draft_logits,
                               loaded.draft(ctx(target, loaded, prompts, [0])).draft_logits)


def test_a_folders_confidence_json_becomes_the_drafters_confidence_model(target, tmp_path):
    """A checkpoint folder may ship a stacked confidence model (confidence.json, next to the
    calibration fitted on its logits): loading attaches it (None without one); a corrupt file
    fails naming the problem."""
    from dspark.confidence import HeadMaxProbConfidence

    d = make(target, "dspark-gated")
    save_pretrained(d, tmp_path / "plain")
    save_pretrained(d, tmp_path / "stacked")
    stack = HeadMaxProbConfidence([[0.5, 0.5, 0.0]] * d.gamma)
    stack.save(tmp_path / "stacked" / "confidence.json")
    assert from_pretrained(tmp_path / "plain", target).confidence_model is None
    assert from_pretrained(tmp_path / "stacked", target).confidence_model == stack
    (tmp_path / "stacked" / "confidence.json").write_text("[]")
    with pytest.raises(ValueError, match="not a confidence model file"):
        from_pretrained(tmp_path / "stacked", target)


def test_a_calibrated_stacked_confidence_json_replaces_the_folders_calibrator(target, tmp_path):
    """A folder's `stacked` confidence.json gives calibrated logits: the folder's calibrator is then
    none (its calibration.json stays the head's, for vLLM / TensorRT-LLM), the engine refuses to
    calibrate them twice, and a vocabulary cut keeps the head and its calibration.json."""
    import dspark
    from dspark.confidence import StackedConfidence
    from dspark.engine import Engine
    from dspark.evaluation.drafter_specs import folder_calibrator

    d = make(target, "dspark-gated")
    save_pretrained(d, tmp_path)
    dspark.get_calibrator("sts", temperatures=[1.5] * d.gamma).save(tmp_path / "calibration.json")
    assert folder_calibrator(tmp_path).name == "sts"  # no confidence.json: the head's calibration
    stack = StackedConfidence(["head", "max-prob", "margin"], [[0.1] * 7] * d.gamma, [0.0] * 3, [1.0] * 3)
    stack.save(tmp_path / "confidence.json")
    loaded = from_pretrained(tmp_path, target)
    assert loaded.confidence_model == stack
    assert folder_calibrator(tmp_path) is None
    assert folder_calibrator(tmp_path, draft_vocab=64).name == "sts"
    with pytest.raises(ValueError, match="calibrate them twice"):
        Engine(target, loaded, calibrator=folder_calibrator(tmp_path, draft_vocab=64))


def test_checkpoint_errors(tmp_path):
    t = FakeTarget("llama")
    d = make(t, "dspark-gated")
    save_pretrained(d, tmp_path / "ok")
    other = FakeTarget("llama", vocab=80)
    with pytest.raises(ValueError, match="vocab size 64 ≠ target's 80"):
        from_pretrained(tmp_path / "ok", other)
    with pytest.raises(ValueError, match="hidden size 32 ≠ target's 48"):
        from_pretrained(tmp_path / "ok", FakeTarget("llama", hidden=48))
    with pytest.raises(CheckpointError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere", t)
    (tmp_path / "ok" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        from_pretrained(tmp_path / "ok", t)
    (tmp_path / "ok" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        from_pretrained(tmp_path / "ok", t)
    with pytest.raises(ValueError, match="holds a dspark drafter, not dflash"):
        save_pretrained(d, tmp_path / "ok2")
        dspark.get_drafter("dflash", target=t, checkpoint=tmp_path / "ok2")
    # a checkpoint fixes the configuration: extra keys are refused, not ignored
    with pytest.raises(ValueError, match="bogus, gamma cannot be set with it"):
        dspark.get_drafter("dspark", target=t, checkpoint=tmp_path / "ok2", gamma=3, bogus=1)
    # γ is bounded (q is [γ, V] per request and round)
    with pytest.raises(ValueError, match="'gamma' must be <= 64"):
        DrafterConfig.for_target(t.config, "dflash", gamma=1000)
    with pytest.raises(ValueError, match="'gamma' must be <= 64"):
        dspark.get_drafter("ngram", vocab_size=64, gamma=65)


def test_build_drafter_needs_a_bound_target():
    cfg = DrafterConfig.for_target(FakeTarget().config, "dflash", num_layers=1)
    d = build_drafter(cfg)
    with pytest.raises(RuntimeError, match="bind_target"):
        d.draft(DraftContext(["r"], [torch.tensor([1, 2])], [SamplingParams()], features=TargetFeatures([torch.zeros(1, 32 * len(cfg.target_layer_ids))])))
