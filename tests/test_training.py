"""Training: losses, initialisation, draft vocabulary, resume, data parallelism, checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.drafters.checkpoint import from_pretrained, save_pretrained
from dspark.drafters.dflash.training import block_forward
from dspark.protocols import TargetFeatures
from dspark.training.batches import global_batch, sample_anchors
from dspark.training.losses import (
    accept_rate,
    analytic_tau,
    block_terms,
    l1_per_token,
    l1_per_token_topk,
    loss_weights,
)
from dspark.training.run import build_for_target
from dspark.training.teacher import build_feature_cache, teacher_forward
from dspark.training.trainer import TrainConfig, TrainData, Trainer, lr_at
from helpers import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")
V = 48


def tiny_model(seed: int = 0):
    return tiny_causal_lm(vocab_size=V, num_layers=6, init_range=0.2, seed=seed, keep_eos=True)


_SAMPLER = None


@torch.no_grad()
def tiny_data(n: int = 12, seed: int = 0):
    """Self-distilled data: random prompts, responses sampled from the tiny target itself."""
    global _SAMPLER
    _SAMPLER = _SAMPLER or tiny_model()
    g = torch.Generator().manual_seed(seed)
    seqs, pls = [], []
    for _ in range(n):
        p = int(torch.randint(3, 8, (1,), generator=g))
        ids = torch.randint(0, V, (1, p), generator=g)
        for _ in range(int(torch.randint(15, 24, (1,), generator=g))):
            probs = torch.softmax(_SAMPLER(input_ids=ids).logits[0, -1], -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)[None]], 1)
        seqs.append(ids[0].tolist())
        pls.append(p)
    return seqs, pls


def frozen_tiny_model():
    """:func:`tiny_model` with its weights frozen: the target a drafter trains against."""
    m = tiny_model()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@pytest.fixture(scope="module")
def model():
    return frozen_tiny_model()


DRAFTERS = {
    "dspark-gated": ("dspark", dict(head="gated-markov", rank=8, confidence=True, draft_vocab_size=33)),
    "dspark-vanilla": ("dspark", dict(head="vanilla-markov", rank=8, confidence=True)),
    "dspark-rnn": ("dspark", dict(head="rnn", rank=8, confidence=True, draft_vocab_size=33)),
    "dflash": ("dflash", {}),
    "eagle3": ("eagle3", dict(draft_vocab_size=40)),
}


def make(model, name, seqs):
    kind, extra = DRAFTERS[name]
    torch.manual_seed(1)
    return build_for_target(model, kind, sequences=seqs, num_layers=1, gamma=4, **extra)


# -- losses ----------------------------------------------------------------------------------


def test_loss_weights_decay_and_are_not_normalised():
    w = loss_weights(torch.ones(7, dtype=torch.bool), 4.0)  # the reference: exp(−j/4), slot 0 weighs 1
    assert float(w[0]) == 1.0 and float(w.sum()) > 1.0
    torch.testing.assert_close(w[1] / w[0], torch.exp(torch.tensor(-0.25)))
    assert torch.equal(loss_weights(torch.tensor([True, True, False])), torch.tensor([1.0, float(torch.exp(torch.tensor(-0.25))), 0.0]))
    assert torch.equal(loss_weights(torch.ones(3, dtype=torch.bool), None), torch.ones(3))


def test_full_teacher_l1_and_acceptance_are_exact():
    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(torch.randn(3, 4, 10, generator=g), -1)
    p = torch.softmax(torch.randn(3, 4, 10, generator=g), -1)
    l1 = l1_per_token(logq, p)
    torch.testing.assert_close(l1, (p - logq.exp()).abs().sum(-1))
    torch.testing.assert_close(accept_rate(l1), torch.minimum(p, logq.exp()).sum(-1))  # 1 − TV = overlap
    top, ids = p.topk(10, -1)
    torch.testing.assert_close(l1_per_token_topk(logq, ids, top), l1)  # k = V: the top-k form is exact
    # a reduced draft vocabulary: q is 0 outside the draft slots, p's mass there is p_out
    slots = torch.tensor([0, 2, 3, 7])
    q_full = torch.zeros(3, 4, 10)
    q_full[..., slots] = logq[..., :4].softmax(-1)
    p_d = p[..., slots]
    torch.testing.assert_close(l1_per_token(logq[..., :4].log_softmax(-1), p_d, 1 - p_d.sum(-1)),
                               (q_full - p).abs().sum(-1))


def test_topk_teacher_bounds_the_true_overlap():
    g = torch.Generator().manual_seed(1)
    logq = torch.log_softmax(torch.randn(2, 3, 20, generator=g), -1)
    p = torch.softmax(2 * torch.randn(2, 3, 20, generator=g), -1)
    top, ids = p.topk(5, -1)
    ids = torch.where(ids == 0, -1, ids)  # a teacher token outside the draft vocabulary
    l1 = l1_per_token_topk(logq, ids, top)
    assert (accept_rate(l1) <= torch.minimum(p, logq.exp()).sum(-1) + 1e-6).all()
    assert (l1 >= (p - logq.exp()).abs().sum(-1) - 1e-6).all()


def test_block_terms_are_sums_so_ranks_add_up():
    g = torch.Generator().manual_seed(2)
    logq = torch.log_softmax(torch.randn(4, 3, 6, generator=g), -1)
    label = torch.randint(0, 6, (4, 3), generator=g)
    p = torch.softmax(torch.randn(4, 3, 6, generator=g), -1)
    w = loss_weights(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool))
    conf = torch.randn(4, 3, generator=g)
    full, nf, _ = block_terms(logq, label, w, conf, p=p)
    a, na, _ = block_terms(logq[:2], label[:2], w[:2], conf[:2], p=p[:2])
    b, nb, _ = block_terms(logq[2:], label[2:], w[2:], conf[2:], p=p[2:])
    torch.testing.assert_close(full, a + b)  # what makes data-parallel ranks add up
    for k in nf:
        torch.testing.assert_close(nf[k], na[k] + nb[k])
    assert float(nf["den"]) == pytest.approx(float(w.sum()))


def test_analytic_tau():
    assert analytic_tau([1.0, 1.0]) == 3.0
    assert analytic_tau([0.5, 0.5]) == pytest.approx(1.75)
    assert analytic_tau([]) == 1.0


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_frac=0.1, min_lr_frac=0.1)
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and max(lrs) == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4, rel=0.05)
    assert all(b <= a + 1e-12 for a, b in zip(lrs[10:], lrs[11:]))


def test_batches_and_anchors_are_deterministic_and_in_the_response():
    cfg = TrainConfig(seqs_per_step=4, anchors_per_seq=5, seed=3)
    assert global_batch(cfg, 7, 10) == global_batch(cfg, 7, 10)
    assert sorted(global_batch(cfg, 0, 4)) == [0, 1, 2, 3]  # an epoch is a permutation
    a = sample_anchors(cfg, 2, 1, 20, 6)
    assert a == sample_anchors(cfg, 2, 1, 20, 6) and len(a) == 5
    assert all(6 <= x <= 18 for x in a)  # the reference: anchor and first label in the response
    assert sample_anchors(cfg, 0, 0, 5, 5) == []


def test_train_config_validates():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(dtype="float8")
    with pytest.raises(ValueError, match="unknown drafter kind"):
        TrainConfig.for_kind("medusa")


# -- drafter construction ----------------------------------------------------------------------


def test_init_copies_the_targets_top_layer(model):
    seqs, _ = tiny_data()
    d = make(model, "dflash", seqs)
    top = model.model.layers[-1]
    torch.testing.assert_close(d.layers[0].q_proj.weight, top.self_attn.q_proj.weight)
    torch.testing.assert_close(d.layers[0].down_proj.weight, top.mlp.down_proj.weight)
    torch.testing.assert_close(d.norm.weight, model.model.norm.weight)


def test_draft_vocabulary_restricts_drafts_and_keeps_q_a_distribution(model):
    from dspark.protocols.drafter import DraftContext
    from dspark.types import SamplingParams

    seqs, _ = tiny_data()
    d = make(model, "dspark-gated", seqs)
    allowed = set(d.draft_ids[:-1].tolist())
    ids = torch.tensor(seqs[0][:10])
    feats = teacher_forward(model, [ids.tolist()], d.target_layer_ids)[0].feats[:-1]
    for params in (SamplingParams.greedy(), SamplingParams.random(1.0)):
        d.release("r")
        ctx = DraftContext(["r"], [ids], [params], [torch.Generator().manual_seed(0)],
                           features=TargetFeatures([feats]))
        blk = d.draft(ctx)
        assert set(blk.tokens.flatten().tolist()) <= allowed
        torch.testing.assert_close(blk.q.sum(-1), torch.ones(1, 4))
        outside = torch.ones(V, dtype=torch.bool)
        outside[list(allowed)] = False
        assert float(blk.q[..., outside].abs().max()) == 0.0
    with pytest.raises(ValueError, match="distinct token ids"):
        d.set_draft_vocab(torch.zeros(32, dtype=torch.long))


# -- training ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_training_raises_the_overlap(model, name, tmp_path):
    seqs, pls = tiny_data()
    d = make(model, name, seqs)
    cfg = TrainConfig.for_kind(DRAFTERS[name][0], steps=40, seqs_per_step=4, anchors_per_seq=6, lr=3e-3,
                               checkpoint_every=1000)
    log = Trainer(d, TrainData(seqs, pls, model=model, teacher="full"), cfg, tmp_path, progress=False).fit()
    first = sum(r["tau"] for r in log[:5]) / 5
    last = sum(r["tau"] for r in log[-5:]) / 5
    assert last > first + 0.02, (first, last)
    assert sum(r["loss"] for r in log[-5:]) < sum(r["loss"] for r in log[:5])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log)


@pytest.mark.parametrize("name", ["dspark-gated", "dspark-rnn", "dflash", "eagle3"])
def test_training_forward_equals_inference(model, name):
    """On a sequence that continues with the drafter's own greedy drafts, teacher forcing feeds
    exactly what inference fed: the training log-probabilities equal draft()'s at every position."""
    from dspark.drafters.eagle3.training import eagle3_forward
    from dspark.protocols.drafter import DraftContext
    from dspark.training.forward import Batch
    from dspark.types import SamplingParams

    seqs, _ = tiny_data()
    d = make(model, name, seqs)
    with torch.no_grad():
        for p in d.parameters():  # a trained-looking drafter: no zero W_up hiding the head
            p.add_(0.05 * torch.randn_like(p))
    prefix = seqs[0][:13]
    f_prefix = teacher_forward(model, [prefix], d.target_layer_ids)[0].feats
    ctx = DraftContext(["r"], [torch.tensor(prefix)], [SamplingParams.greedy()], [torch.Generator()],
                       features=TargetFeatures([f_prefix[:-1]]))
    blk = d.draft(ctx)
    s = prefix + blk.tokens[0].tolist() + [0]
    f, _, ti, tl, _ = teacher_forward(model, [s], d.target_layer_ids, 4, teacher="topk")[0]
    a = len(prefix) - 1
    batch = Batch(torch.tensor([s]), torch.tensor([len(s)]), torch.tensor([3]), f[None], ti[None], tl[None],
                  torch.tensor([[a, 4]]))
    with torch.no_grad():
        t = (eagle3_forward if name == "eagle3" else block_forward)(d, batch)
    slots = d.draft_ids[:-1] if d.vocab_map is not None else torch.arange(V)
    want = torch.log_softmax(blk.draft_logits[0][:, slots], -1)  # [γ, V_d − 1]
    got = t.logq[0][:, : slots.numel()].log_softmax(-1)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    if t.conf_logits is not None:
        torch.testing.assert_close(t.conf_logits[0], blk.confidence_logits[0], atol=2e-4, rtol=2e-4)


def test_resume_replays_the_same_loss_curve(model, tmp_path):
    seqs, pls = tiny_data()
    data = TrainData(seqs, pls, model=model, top_k=8)
    cfg = TrainConfig.for_kind("dspark", steps=8, seqs_per_step=4, anchors_per_seq=4, checkpoint_every=3)
    straight = Trainer(make(model, "dspark-gated", seqs), data, cfg, tmp_path / "a", progress=False).fit()

    t = Trainer(make(model, "dspark-gated", seqs), data, cfg, tmp_path / "b", progress=False)
    t.fit(on_step=lambda r: setattr(t, "_stop", r["step"] == 4))  # "killed" after step 5
    assert t.step == 5 and (tmp_path / "b" / "state.pt").is_file()
    again = Trainer(make(model, "dspark-gated", seqs), data, cfg, tmp_path / "b", progress=False)
    assert again.resume() and again.step == 5
    resumed = again.fit()
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], rel=1e-6, abs=1e-7)


def test_resume_refuses_a_corrupt_or_foreign_state(model, tmp_path):
    seqs, pls = tiny_data()
    data = TrainData(seqs, pls, model=model, top_k=8)
    cfg = TrainConfig.for_kind("dflash", steps=2, seqs_per_step=2, anchors_per_seq=2)
    Trainer(make(model, "dflash", seqs), data, cfg, tmp_path, progress=False).fit()
    with pytest.raises(ValueError, match="another drafter config"):
        Trainer(make(model, "eagle3", seqs), TrainData(seqs, pls, model=model, teacher="topk", top_k=8),
                TrainConfig.for_kind("eagle3", steps=2), tmp_path, progress=False).resume()
    key = next(iter(torch.load(tmp_path / "state.pt", weights_only=True)["model"]))
    (tmp_path / "bad").mkdir()
    for broken, match in ((lambda st: st.pop("model"), "no 'model' entry"),
                          (lambda st: st.update(step="abc"), "step 'abc' is not a non-negative integer"),
                          (lambda st: st["model"].update({key: torch.zeros(3)}), f"{key} has shape \\(3,\\)"),
                          (lambda st: st["model"].pop(key), "weights missing")):
        st = torch.load(tmp_path / "state.pt", weights_only=True)
        broken(st)
        torch.save(st, tmp_path / "bad" / "state.pt")
        trainer = Trainer(make(model, "dflash", seqs), data, cfg, tmp_path / "bad", progress=False)
        before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
        with pytest.raises(ValueError, match=match) as err:
            trainer.resume()
        assert "move it away" in str(err.value) and "\n" not in str(err.value)
        assert all(torch.equal(v, trainer.drafter.state_dict()[k]) for k, v in before.items())  # nothing applied
    (tmp_path / "state.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt"):
        Trainer(make(model, "dflash", seqs), data, cfg, tmp_path, progress=False).resume()


class _Planted:
    """A pickle that runs code when unpickled (what a hostile state.pt would hold)."""

    def __reduce__(self):
        return (_ran.append, ("code ran",))


_ran: list[str] = []


def test_resume_never_unpickles_a_planted_state(model, tmp_path):
    seqs, pls = tiny_data()
    data = TrainData(seqs, pls, model=model, top_k=8)
    cfg = TrainConfig.for_kind("dflash", steps=2, seqs_per_step=2, anchors_per_seq=2)
    torch.save({"step": 1, "payload": _Planted()}, tmp_path / "state.pt")
    with pytest.raises(ValueError, match="not a dspark training state"):
        Trainer(make(model, "dflash", seqs), data, cfg, tmp_path, progress=False).resume()
    assert _ran == [], "resume unpickled an arbitrary object"


def test_feature_cache_equals_online_teacher(model, tmp_path):
    seqs, pls = tiny_data(5)
    cache = build_feature_cache(model, seqs, tmp_path, [1, 3, 4], batch_size=2, shard_size=2, progress=False)
    assert len(cache) == 5 and cache.teacher == "full" and cache.top_k is None
    online = teacher_forward(model, [seqs[3]], [3, 1])[0]
    cached = cache.get(3, [3, 1])
    torch.testing.assert_close(cached.feats, online.feats, atol=2e-3, rtol=2e-3)  # fp16 storage
    torch.testing.assert_close(cached.last_hidden, online.last_hidden, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(cached.last_lse, online.last_lse, atol=2e-3, rtol=2e-3)
    with torch.no_grad():  # the final-normed last state: the LM head of it is the target's logits
        logits = model(input_ids=torch.tensor([seqs[3]])).logits[0]
        torch.testing.assert_close(online.last_hidden @ model.lm_head.weight.T, logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="holds layers"):
        cache.get(0, [2])
    with pytest.raises(ValueError, match="other data"):
        build_feature_cache(model, seqs[:4], tmp_path, [1, 3, 4], progress=False)
    with pytest.raises(ValueError, match="'full' teacher, not 'topk'"):
        build_feature_cache(model, seqs, tmp_path, [1, 3, 4], top_k=6, shard_size=2, progress=False, teacher="topk")
    # an interrupted build resumes at the first incomplete shard
    meta = json.loads((tmp_path / "cache.json").read_text())
    meta["complete_shards"] = 1
    (tmp_path / "cache.json").write_text(json.dumps(meta))
    (tmp_path / "shard-00002.safetensors").unlink()
    assert len(build_feature_cache(model, seqs, tmp_path, [1, 3, 4], shard_size=2, progress=False)) == 5


def test_feature_cache_is_keyed_by_the_target_that_built_it(model, tmp_path):
    """A same-shaped target with other weights, or the same target in another dtype, must not reuse
    the features: refused in one sentence naming both, the cache left as it was."""
    import copy

    seqs, _ = tiny_data(4)
    build_feature_cache(model, seqs, tmp_path, [1, 3], shard_size=2, progress=False)
    kept = _cache_bytes(tmp_path)
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    for stranger in (other, copy.deepcopy(model).to(torch.bfloat16)):
        with pytest.raises(ValueError, match="holds features of another target") as err:
            build_feature_cache(stranger, seqs, tmp_path, [1, 3], shard_size=2, progress=False)
        assert "use another folder" in str(err.value) and "\n" not in str(err.value)
    assert _cache_bytes(tmp_path) == kept
    assert len(build_feature_cache(model, seqs, tmp_path, [1, 3], shard_size=2, progress=False)) == 4  # its own target


def _cache_bytes(root):
    return {f.name: f.read_bytes() for f in sorted(root.glob("shard-*.safetensors"))}


def test_feature_cache_grows_with_its_data(model, tmp_path, monkeypatch):
    """Appended sequences reuse the unchanged leading shards (counted by the teacher forwards run);
    the grown cache equals one built from scratch; a hard-linked copy grows without touching the
    original; a cache sharing no shard with the data is refused, not overwritten."""
    from dspark.training import teacher as tm

    seqs, _ = tiny_data(7)
    first = tmp_path / "first"
    tm.build_feature_cache(model, seqs[:5], first, [1, 3], batch_size=1, shard_size=2, progress=False)
    before = _cache_bytes(first)
    grown = tmp_path / "grown"  # a copy of the prefix cache by hard links (cp -al), then grown
    grown.mkdir()
    for f in first.iterdir():
        os.link(f, grown / f.name)
    ran = []
    real = tm.teacher_forward
    monkeypatch.setattr(tm, "teacher_forward", lambda m, s, *a, **k: ran.extend(s) or real(m, s, *a, **k))
    cache = tm.build_feature_cache(model, seqs, grown, [1, 3], batch_size=1, shard_size=2, progress=False)
    assert sorted(ran) == sorted(seqs[4:]), "shards 0-1 (sequences 0-3) are unchanged and must be kept"
    assert _cache_bytes(first) == before and len(tm.FeatureCache(first)) == 5, "the original cache changed"
    fresh = tm.build_feature_cache(model, seqs, tmp_path / "fresh", [1, 3], batch_size=1, shard_size=2,
                                   progress=False)
    assert len(cache) == len(fresh) == 7
    for i in range(7):
        a, b = cache.get(i, [3, 1]), fresh.get(i, [3, 1])
        assert torch.equal(a.feats, b.feats) and torch.equal(a.last_hidden, b.last_hidden)
    # an edit in the middle keeps the shards before it
    ran.clear()
    edited = [*seqs[:2], [*seqs[2][:-1], (seqs[2][-1] + 1) % V], *seqs[3:]]
    tm.build_feature_cache(model, edited, grown, [1, 3], batch_size=1, shard_size=2, progress=False)
    assert sorted(ran) == sorted(edited[2:])
    # other data: refused, and the cache is left as it was
    ran.clear()
    kept = _cache_bytes(grown)
    with pytest.raises(ValueError, match="no shard of it holds these sequences"):
        tm.build_feature_cache(model, seqs[::-1], grown, [1, 3], batch_size=1, shard_size=2, progress=False)
    assert ran == [] and _cache_bytes(grown) == kept and not list(grown.glob("*.tmp"))


def test_feature_cache_written_before_digests_grows_when_its_lengths_match(model, tmp_path):
    """A cache without shard digests is recognised as a prefix by its sequence and token counts and
    each shard's stored lengths; the digests are then recorded. Other lengths: refused."""
    from dspark.training.teacher import build_feature_cache

    seqs, _ = tiny_data(7)
    build_feature_cache(model, seqs[:5], tmp_path, [1, 3], batch_size=2, shard_size=2, progress=False)
    meta = json.loads((tmp_path / "cache.json").read_text())
    legacy = {k: v for k, v in meta.items() if k != "shard_digests"}
    (tmp_path / "cache.json").write_text(json.dumps(legacy))
    longer = [seqs[0], [*seqs[1], 5], *seqs[2:]]  # sequence 1 has another length
    with pytest.raises(ValueError, match="no shard of it holds these sequences"):
        build_feature_cache(model, longer, tmp_path, [1, 3], batch_size=2, shard_size=2, progress=False)
    assert len(build_feature_cache(model, seqs, tmp_path, [1, 3], batch_size=2, shard_size=2, progress=False)) == 7
    meta = json.loads((tmp_path / "cache.json").read_text())
    assert meta["num_sequences"] == 7 and meta["complete_shards"] == 4 and len(meta["shard_digests"]) == 4


def test_full_teacher_with_a_reduced_vocabulary_reads_only_the_draft_rows(model):
    """With the cached full-vocabulary normaliser the step multiplies only the V_d draft rows of
    the LM head; the probabilities (and the mass outside the draft vocabulary) are the same."""
    from dspark.training.forward import Batch, teacher_at

    seqs, _ = tiny_data(3)
    d = make(model, "dspark-gated", seqs)  # draft vocabulary of 32 (+ placeholder)
    rows = teacher_forward(model, seqs[:2], d.target_layer_ids)
    n = max(len(s) for s in seqs[:2])
    last, lse = torch.zeros(2, n, 32), torch.zeros(2, n)
    for r, row in enumerate(rows):
        last[r, : len(row.feats)], lse[r, : len(row.feats)] = row.last_hidden, row.last_lse
    ids = torch.zeros(2, n, dtype=torch.long)
    pos = torch.tensor([[3, 5, 5, 9, 14], [2, 2, 4, 6, 8]])
    common = (ids, torch.tensor([len(s) for s in seqs[:2]]), torch.tensor([3, 3]), torch.zeros(2, n, 1), None, None,
              torch.zeros(2, 1, dtype=torch.long))
    _, _, p_a, out_a = teacher_at(d, Batch(*common, last_hidden=last, last_lse=lse), pos)
    _, _, p_b, out_b = teacher_at(d, Batch(*common, last_hidden=last), pos)
    torch.testing.assert_close(p_a, p_b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)
    assert float(out_a.min()) > 0 and torch.equal(p_a[..., -1], torch.zeros(2, 5))  # placeholder slot
    full = torch.softmax(rows[0].last_hidden @ model.lm_head.weight.T, -1)  # [n, V]
    torch.testing.assert_close(p_a[0, 0, :-1], full[3, d.draft_ids[:-1]], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1024, 4, 1])  # all sequences in one matmul, groups, one sequence each
@pytest.mark.parametrize("autocast", [False, True])
def test_teacher_at_equals_a_per_position_softmax(model, monkeypatch, rows, autocast):
    """The full teacher at every (sequence, position) equals softmax(W_lm z) computed alone for that
    position — in fp32, and under bf16 autocast (both operands rounded to bf16, as autocast's own
    matmul rounds them) — however the sequences are grouped into matmuls."""
    from dspark.training import forward as fw

    monkeypatch.setattr(fw, "_TEACHER_ROWS", rows)
    seqs, _ = tiny_data(3)
    d = make(model, "dspark-vanilla", seqs)  # full vocabulary
    g = torch.Generator().manual_seed(3)
    last = torch.randn(3, 20, 32, generator=g)
    pos = torch.tensor([[3, 5, 5, 9, 14], [2, 2, 4, 6, 8], [19, 0, 7, 7, 1]])
    common = (torch.zeros(3, 20, dtype=torch.long), torch.tensor([20, 20, 20]), torch.tensor([3, 3, 3]),
              torch.zeros(3, 20, 1), None, None, torch.zeros(3, 1, dtype=torch.long))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, _, p, out = fw.teacher_at(d, fw.Batch(*common, last_hidden=last), pos)
    W = model.lm_head.weight
    for r in range(3):
        for m in range(5):
            z = last[r, pos[r, m]]
            if autocast:
                logits = (z.bfloat16()[None] @ W.bfloat16().T)[0]
            else:
                logits = W @ z
            want = torch.softmax(logits.float(), -1)
            torch.testing.assert_close(p[r, m], want, atol=1e-6, rtol=1e-5)
    assert torch.equal(out, torch.zeros(3, 5))


def test_topk_feature_cache_and_caches_written_before_the_teacher_was_recorded(model, tmp_path):
    seqs, pls = tiny_data(5)
    cache = build_feature_cache(model, seqs, tmp_path, [1, 3], top_k=6, batch_size=2, shard_size=2,
                                progress=False, teacher="topk")
    online = teacher_forward(model, [seqs[3]], [3, 1], 6, teacher="topk")[0]
    cached = cache.get(3, [3, 1])
    assert cache.teacher == "topk" and cached.last_hidden is None and torch.equal(cached.top_ids, online.top_ids)
    # an old cache (no "teacher" key) is a top-k cache: it loads, resumes, and refuses the full teacher
    meta = json.loads((tmp_path / "cache.json").read_text())
    del meta["teacher"]
    (tmp_path / "cache.json").write_text(json.dumps(meta))
    from dspark.training.teacher import FeatureCache

    old = FeatureCache(tmp_path)
    assert old.teacher == "topk" and old.top_k == 6 and torch.equal(old.get(3, [3, 1]).top_ids, online.top_ids)
    with pytest.raises(ValueError, match="'topk' teacher, not 'full'"):
        build_feature_cache(model, seqs, tmp_path, [1, 3], progress=False)
    data = TrainData(seqs, pls, cache=old)
    assert data.teacher == "topk"
    d = make(model, "dspark-vanilla", seqs)
    cfg = TrainConfig.for_kind("dspark", steps=2, seqs_per_step=2, anchors_per_seq=3)
    d2 = build_for_target(model, "dspark", sequences=seqs, num_layers=1, gamma=4, layer_ids=(1, 3), head="vanilla-markov",
                          rank=8, confidence=True)
    log = Trainer(d2, data, cfg, tmp_path / "run", progress=False).fit()
    assert len(log) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    del d


def test_int8_checkpoint_round_trip(model, tmp_path):
    seqs, _ = tiny_data()
    d = make(model, "dspark-gated", seqs)
    with torch.no_grad():
        d.head.w_up.weight.normal_(0, 0.1)
    save_pretrained(d, tmp_path / "q", dtype=torch.float16, quantize=True)

    class T:
        name, vocab_size, hidden_size, num_layers = "target", V, 32, 6
    T.model = model
    loaded = from_pretrained(tmp_path / "q", T())
    assert torch.equal(loaded.draft_ids, d.draft_ids)
    for k, v in d.state_dict().items():
        if v.is_floating_point():
            tol = 1.5 * v.abs().max().item() / 127 + 1e-3
            assert (loaded.state_dict()[k].float() - v.float()).abs().max() <= tol, k


# -- data parallel ------------------------------------------------------------------------------


def ddp_equals_one_process(tmp_path: Path, *, two_args: tuple[str, ...] = (), steps: int = 4,
                           extra: tuple[str, ...] = (), port: int = 29517) -> str:
    """Train the tiny target's drafter with ``dspark train`` in one process and with torchrun in two
    (gloo; ``two_args`` added there only); assert equal losses and weights; return torchrun's stderr."""
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun is not installed")
    from safetensors.torch import load_file

    from dspark.data.selfdistill import Record

    tiny_model().save_pretrained(tmp_path / "target")
    seqs, pls = tiny_data(8)
    (tmp_path / "data").mkdir()
    with (tmp_path / "data" / "train.jsonl").open("w") as fh:
        for i, (s, p) in enumerate(zip(seqs, pls)):
            fh.write(json.dumps(Record(str(i), "x", "p", tuple(s[:p]), tuple(s[p:])).to_dict()) + "\n")
    common = ["--data", str(tmp_path / "data"), "--target", str(tmp_path / "target"), "--kind", "dspark",
              "--rank", "8", "--gamma", "4", "--steps", str(steps), "--seqs-per-step", "4", "--anchors", "4",
              "--features", "online", "--save-dtype", "float32", "--quiet", "--lr", "3e-3", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "dspark", "train", "--out", str(tmp_path / "one"), *common],
                         env=env, capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stderr
    torchrun = str(Path(sys.executable).parent / "torchrun")
    two = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(port), "-m", "dspark", "train",
                          "--out", str(tmp_path / "two"), *two_args, *common], env=env, capture_output=True,
                         text=True, timeout=900)
    assert two.returncode == 0, two.stderr[-3000:]
    la = [json.loads(x) for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lb] == pytest.approx([r["loss"] for r in la], rel=1e-5)
    wa = load_file(str(tmp_path / "one" / "checkpoint" / "model.safetensors"))
    wb = load_file(str(tmp_path / "two" / "checkpoint" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4)
    return two.stderr


@pytest.mark.slow
def test_ddp_two_processes_equal_one(tmp_path):
    """torchrun, 2 CPU processes (gloo), each half of every global batch == 1 process."""
    ddp_equals_one_process(tmp_path, extra=("--top-k", "8"))


def test_train_cli_bad_input_is_one_line(tmp_path, capsys):
    from dspark.cli import main

    assert main(["train", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "does not exist (build it with `dspark data`)" in err and "Traceback" not in err
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text('{"key": "k", "domain": "d", "prompt": "p", "prompt_ids": [1, 2], '
                                                '"response_ids": [3]}\n')
    assert main(["train", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o")]) == 2
    assert "no usable training sequences" in capsys.readouterr().err
