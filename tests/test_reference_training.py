"""dspark's training forward and losses against the reference training cases (DeepSpec's
``Qwen3DSparkModel.forward`` + ``compute_dspark_loss``; speculators' DSpark / DFlash forwards).

tests/fixtures/reference-drafters/README.md, "The DeepSpec training case", defines every tensor.
"""

from __future__ import annotations

import pytest
import torch

import reference_fixtures as rf
from dspark.drafters.config import DrafterConfig, TargetInfo
from dspark.drafters.dflash.training import block_forward
from dspark.drafters.layers import LayerShape
from dspark.drafters.neural import build_drafter
from dspark.training.batches import anchor_candidates, sample_anchors
from dspark.training.forward import Batch
from dspark.training.losses import (
    accept_rate,
    bce_per_token,
    block_terms,
    ce_per_token,
    eagle3_loss_weights,
    eval_mask,
    l1_per_token,
    loss_weights,
    normalise,
)
from dspark.training.trainer import TrainConfig
from reference_fixtures import DEEPSPEC_BLOCK, cases, folder, target_model

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS = {"vanilla": "vanilla-markov", "gated": "gated-markov", "rnn": "rnn"}
RULES = [  # DeepSpec checkpoint keys → dspark BlockDrafter keys
    (".self_attn.", "."), (".mlp.", "."), ("input_layernorm", "input_norm"), ("post_attention_layernorm", "post_norm"),
    ("markov_head.markov_w1", "head.w_down"), ("markov_head.markov_w2", "head.w_up"),
    ("markov_head.gate_proj", "head.w_g"), ("markov_head.joint_proj", "head.w"),
]


def _drafter(name: str):
    """A dspark BlockDrafter carrying the fixture checkpoint ``name`` (DeepSpec key names), its
    shape built by hand from the checkpoint's own DeepSpec config.json (not through dspark's reader)."""
    from safetensors.torch import load_file

    sd = load_file(str(folder(name) / "model.safetensors"))
    c = rf.config(name)
    dflash = not c["markov_rank"]  # DeepSpec's DFlash: the same class, markov_rank 0, no confidence head
    assert dflash == (not c["enable_confidence_head"])
    layer = LayerShape(c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                       c["intermediate_size"], c["rms_norm_eps"], c["rope_parameters"]["rope_theta"], True)
    cfg = DrafterConfig(kind="dflash" if dflash else "dspark", vocab_size=c["vocab_size"], layer=layer,
                        target=TargetInfo("target", c["vocab_size"], c["hidden_size"], c["num_target_layers"]),
                        target_layer_ids=tuple(c["target_layer_ids"]), num_layers=c["num_hidden_layers"],
                        gamma=c["block_size"], head=None if dflash else HEADS[c["markov_head_type"]],
                        rank=c["markov_rank"] or 1, confidence=bool(c["enable_confidence_head"]),
                        mask_token_id=c["mask_token_id"])
    d = build_drafter(cfg)
    state = {}
    for k, v in sd.items():
        if k in ("embed_tokens.weight", "lm_head.weight"):
            continue
        k = {"fc.weight": "fuse.weight", "hidden_norm.weight": "fuse_norm.weight"}.get(k, k)
        for a, b in RULES:
            k = k.replace(a, b)
        state[k] = v
    missing, unexpected = d.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if m != "draft_ids"], (missing, unexpected)
    d.bind_target(sd["embed_tokens.weight"], sd["lm_head.weight"])
    return d.eval()


def _prompt_len(t: dict[str, torch.Tensor]) -> int:
    """The case's "prompt": the loss mask's leading zeros."""
    return int(t["train/loss_mask"].nonzero()[0])


def _shape(name: str) -> tuple[int, int]:
    """(anchors, block size) of the training case of DeepSpec folder ``name``."""
    return cases(name)[1]["train"]["num_anchors"], rf.block_size(name)


def _batch(t: dict[str, torch.Tensor], anchors: list[int], *, feats: str = "train/target_hidden_states",
           last: str | None = "train/target_last_hidden_states") -> Batch:
    ids = t["train/input_ids"][None]
    n = ids.shape[1]
    return Batch(ids, torch.tensor([n]), torch.tensor([_prompt_len(t)]), t[feats][None], None, None,
                 torch.tensor([anchors]), last_hidden=t[last][None] if last else None,
                 loss_mask=t["train/loss_mask"][None])


@pytest.mark.parametrize("name", DEEPSPEC_BLOCK)
def test_training_forward_and_loss_match_deepspec(name):
    t, js = cases(name)
    d = _drafter(name)
    anchors = t["train/anchor_positions"].tolist()
    assert len(anchors) == js["train"]["num_anchors"] and t["train/input_ids"].numel() == js["train"]["seq_len"]
    with torch.no_grad():
        out = block_forward(d, _batch(t, anchors))
    tol = dict(atol=1e-5, rtol=1e-5)
    assert out.logits.shape == (*_shape(name), rf.vocab_size())
    torch.testing.assert_close(out.hidden, t["train/block_hidden"].reshape(*_shape(name), rf.hidden_size()), **tol)
    torch.testing.assert_close(out.logits, t["train/draft_logits"], **tol)
    torch.testing.assert_close(out.logq, t["train/draft_logprobs"], **tol)
    torch.testing.assert_close(out.p.log(), t["train/teacher_logprobs"], **tol)
    assert torch.equal(out.label, t["train/target_ids"])
    assert torch.equal(out.valid.long(), t["train/eval_mask"].long())
    w = loss_weights(out.valid, js["train"]["loss"]["loss_decay_gamma"])
    assert torch.equal(w, t["train/loss_weight"])
    torch.testing.assert_close(ce_per_token(out.logq, out.label) * out.valid, t["train/ce_per_token"] * out.valid, **tol)
    l1 = l1_per_token(out.logq, out.p, out.p_out)
    torch.testing.assert_close(l1, t["train/l1_per_token"], **tol)
    torch.testing.assert_close(accept_rate(l1), t["train/accept_rate"], **tol)
    lam = js["train"]["loss"]
    total, nums, per = block_terms(out.logq, out.label, w, out.conf_logits, p=out.p, p_out=out.p_out,
                                   lambda_ce=lam["ce_loss_alpha"], lambda_l1=lam["l1_loss_alpha"],
                                   lambda_conf=lam["confidence_head_alpha"])
    if out.conf_logits is not None:
        torch.testing.assert_close(out.conf_logits, t["train/confidence_logits"], **tol)
        torch.testing.assert_close(bce_per_token(out.conf_logits, accept_rate(l1)), t["train/bce_per_token"], **tol)
        torch.testing.assert_close(per["bce"], t["train/bce_per_token"], **tol)
    else:
        assert "train/confidence_logits" not in t
    close = dict(rel=1e-5, abs=1e-6)
    for term, key in (("ce", "ce_loss"), ("l1", "l1_loss"), ("conf", "confidence_loss")):
        alpha = lam[{"ce": "ce_loss_alpha", "l1": "l1_loss_alpha", "conf": "confidence_head_alpha"}[term]]
        if not alpha:  # the reference skips a term whose weight is 0 (num = den = 0); dspark still reports it
            assert lam[f"{key}_num"] == 0.0
            continue
        assert float(nums[term]) == pytest.approx(lam[f"{key}_num"], **close)
        assert float(nums["den"]) == pytest.approx(lam[f"{key}_den"], **close)
        assert float(normalise(nums[term], nums["den"])) == pytest.approx(lam[key], **close)
    assert float(normalise(total, nums["den"])) == pytest.approx(lam["loss"], **close)


@pytest.mark.parametrize("name", ["speculators-dspark", "speculators-dflash"])
def test_training_logits_match_speculators(name):
    t, _ = cases(name)
    d = _drafter(rf.twin(name))  # the DeepSpec folder with the same tensors
    batch = _batch(t, t["train/anchor_positions"].tolist(), feats="train/hidden_states", last=None)
    n = batch.ids.shape[1]
    batch = Batch(batch.ids, batch.lengths, batch.prompt_lens, batch.feats, torch.zeros(1, n, 1, dtype=torch.long),
                  torch.zeros(1, n, 1), batch.anchors, loss_mask=batch.loss_mask)
    with torch.no_grad():
        out = block_forward(d, batch)
    torch.testing.assert_close(out.logits, t["train/logits"], atol=1e-4, rtol=1e-4)
    if "train/confidence_logits" in t:
        torch.testing.assert_close(out.conf_logits, t["train/confidence_logits"], atol=1e-4, rtol=1e-4)


def test_full_teacher_from_the_targets_final_normed_state():
    """teacher_forward's last hidden state is the final-normed one DeepSpec caches: the LM head of
    it is the target's logits, and the fixture's features / last states are reproduced."""
    from dspark.training.teacher import teacher_forward

    t, _ = cases("deepspec-dspark-vanilla")
    model = target_model()
    ids = t["train/input_ids"].tolist()
    layers = list(rf.layer_ids("deepspec-dspark-vanilla"))
    row = teacher_forward(model, [ids], layers)[0]
    tol = dict(atol=2e-4, rtol=1e-4)  # DeepSpec's hooked forward vs a plain one: attention rounding
    torch.testing.assert_close(row.feats, t["train/target_hidden_states"], **tol)
    torch.testing.assert_close(row.last_hidden, t["train/target_last_hidden_states"], **tol)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(row.last_hidden @ model.lm_head.weight.T, logits, atol=1e-4, rtol=1e-4)
    topk = teacher_forward(model, [ids], layers, 5, teacher="topk")[0]
    assert topk.last_hidden is None and topk.top_ids.shape == (len(ids), 5)


def test_eval_mask_and_weights_on_the_fixture_layout():
    t, _ = cases("deepspec-dflash")
    a = t["train/anchor_positions"]
    n_anchors, block = _shape("deepspec-dflash")
    m = eval_mask((a[:, None] + torch.arange(block) + 1)[None], t["train/loss_mask"][None],
                  torch.ones(1, n_anchors, dtype=torch.bool))
    assert torch.equal(m[0].long(), t["train/eval_mask"].long())
    assert torch.equal(loss_weights(m[0]), t["train/loss_weight"])
    assert not m[0, :, :].any() or loss_weights(m[0])[0, 0] == 1.0
    w = eagle3_loss_weights(torch.ones(2, 3, dtype=torch.bool), 0.8, torch.tensor([4.0, 2.0]))
    torch.testing.assert_close(w, torch.tensor([[1, 0.8, 0.64], [1, 0.8, 0.64]]) / torch.tensor([[4.0], [2.0]]))


def test_anchors_only_inside_the_response():
    cfg = TrainConfig(anchors_per_seq=40, seed=5)
    assert anchor_candidates(10, 4) == [4, 5, 6, 7, 8]  # loss_mask[a] = loss_mask[a+1] = 1
    a = sample_anchors(cfg, 3, 2, 30, 9)
    assert a == sorted(set(a)) and a == list(range(9, 29))  # every candidate, none in the prompt
    cfg = TrainConfig(anchors_per_seq=4, seed=5)
    a = sample_anchors(cfg, 3, 2, 30, 9)
    assert len(a) == 4 and all(9 <= x <= 28 for x in a) and a == sample_anchors(cfg, 3, 2, 30, 9)
    assert sample_anchors(cfg, 3, 3, 30, 9) != a or sample_anchors(cfg, 4, 2, 30, 9) != a
    t, _ = cases("deepspec-dflash")
    mask = t["train/loss_mask"].tolist()
    S = len(mask)
    cand = anchor_candidates(S, _prompt_len(t), mask)
    assert set(t["train/anchor_positions"].tolist()) <= set(cand)
    # DeepSpec's rule (the fixture README): a with loss_mask[a] = loss_mask[a + 1] = 1; none in a
    # gap, none just before one, none at the last position
    assert cand == [a for a in range(S - 1) if mask[a] and mask[a + 1]]
    assert cand and S - 1 not in cand
    assert sample_anchors(cfg, 0, 0, 6, 5) == []  # a one-token response has no label after it


@pytest.mark.parametrize("name", ["deepspec-dspark-gated", "deepspec-dflash"])
def test_two_halves_of_a_batch_sum_to_the_whole(name):
    """What data parallelism relies on: (num, den) of two halves add up to the whole batch's,
    so R ranks that all-reduce them give exactly the single-process loss and gradient."""
    t, js = cases(name)
    d = _drafter(name)
    anchors = t["train/anchor_positions"].tolist()
    b = _batch(t, anchors)
    # the second row: other valid anchors (every candidate the first row does not use, spread), one slot empty
    mask = t["train/loss_mask"].tolist()
    others = [a for a in anchor_candidates(len(mask), _prompt_len(t), mask) if a not in anchors]
    k = len(anchors) - 1
    assert k >= 1 and len(others) >= k
    second = [others[round(i * (len(others) - 1) / max(k - 1, 1))] for i in range(k)] + [-1]
    assert len(set(second[:-1])) == k
    two = Batch(b.ids.repeat(2, 1), b.lengths.repeat(2), b.prompt_lens.repeat(2), b.feats.repeat(2, 1, 1), None, None,
                torch.tensor([anchors, second]), last_hidden=b.last_hidden.repeat(2, 1, 1),
                loss_mask=b.loss_mask.repeat(2, 1))

    def terms(batch):
        d.zero_grad()
        out = block_forward(d, batch)
        total, nums, _ = block_terms(out.logq, out.label, loss_weights(out.valid), out.conf_logits, p=out.p,
                                     p_out=out.p_out)
        total.backward()
        return total.detach(), nums["den"], [p.grad.clone() for p in d.parameters() if p.grad is not None]

    whole, den, g = terms(two)
    parts = [terms(Batch(*(getattr(two, f)[i : i + 1] if getattr(two, f) is not None else None
                           for f in ("ids", "lengths", "prompt_lens", "feats", "top_ids", "top_logp", "anchors",
                                     "last_hidden", "loss_mask")))) for i in (0, 1)]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts[0][1] + parts[1][1], den)
    for ga, gb, gw in zip(parts[0][2], parts[1][2], g):
        torch.testing.assert_close((ga + gb) / (den + 1e-6), gw / (den + 1e-6), rtol=1e-4, atol=1e-6)
    assert float(parts[0][1]) == pytest.approx(js["train"]["loss"]["ce_loss_den"], rel=1e-6)
