"""Value types, the n-gram drafter, the built-in confidence models and model-loading errors (fast)."""

from __future__ import annotations

import math

import pytest
import torch

import dspark
from dspark.confidence import DraftHeadConfidence, MaxProbConfidence, max_prob_logits
from dspark.drafters.ngram import NGramDrafter, lookup_continuation
from dspark.models import load_causal_lm
from dspark.protocols import DraftContext
from dspark.types import DraftBlock, SamplingParams, Schedule, VerifyResult

# --------------------------------------------------------------------------------------------
# dummy() constructors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("R,gamma,V", [(1, 1, 2), (2, 4, 8), (5, 3, 17)])
def test_draft_block_dummy_is_consistent(seed, R, gamma, V):
    b = DraftBlock.dummy(R, gamma, V, seed=seed)
    assert (b.num_requests, b.gamma, b.vocab_size) == (R, gamma, V)
    assert b.tokens.dtype == torch.long and b.tokens.shape == (R, gamma)
    assert b.q.shape == (R, gamma, V)
    torch.testing.assert_close(b.q.sum(-1), torch.ones(R, gamma))
    assert bool((b.q >= 0).all())
    # tokens are sampled from q: each has positive probability under its own q
    assert bool((b.q.gather(-1, b.tokens[..., None]) > 0).all())
    assert bool(((b.tokens >= 0) & (b.tokens < V)).all())
    torch.testing.assert_close(torch.softmax(b.draft_logits, -1), b.q)
    assert b.valid_lengths.tolist() == [gamma] * R
    assert b.confidence_logits is not None and b.confidence_logits.shape == (R, gamma)
    # deterministic per seed
    again = DraftBlock.dummy(R, gamma, V, seed=seed)
    assert torch.equal(again.tokens, b.tokens) and torch.equal(again.q, b.q)


def test_draft_block_dummy_without_confidence_and_with_confidence():
    b = DraftBlock.dummy(3, 2, 5, with_confidence=False)
    assert b.confidence_logits is None
    z = torch.zeros(3, 2)
    b2 = b.with_confidence(z)
    assert b2.confidence_logits is z and b.confidence_logits is None  # frozen: a new value
    with pytest.raises(ValueError, match=r"DraftBlock\.confidence_logits must have shape \[3, 2\]"):
        b.with_confidence(torch.zeros(3, 3))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("R,gamma", [(1, 1), (2, 4), (6, 7)])
def test_schedule_dummy_is_consistent(seed, R, gamma):
    s = Schedule.dummy(R, gamma, seed=seed)
    assert s.num_requests == R and s.survival.shape == (R, gamma)
    assert bool(((s.lengths >= 0) & (s.lengths <= gamma)).all())
    a = s.survival
    assert bool(((a >= 0) & (a <= 1)).all())
    assert bool((a[:, 1:] <= a[:, :-1] + 1e-7).all()), "survival must be non-increasing in j"
    tau = sum(1 + float(a[r, : int(s.lengths[r])].sum()) for r in range(R))
    assert s.expected_tokens == pytest.approx(tau, rel=1e-5)
    assert s.batch_size == R + int(s.lengths.sum())  # packed accounting Σ(1 + ℓ)
    assert math.isnan(s.expected_throughput)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("R,gamma", [(1, 1), (3, 4), (8, 2)])
def test_verify_result_dummy_is_consistent(seed, R, gamma):
    v = VerifyResult.dummy(R, gamma, seed=seed)
    assert v.accepted.shape == (R,) and v.accept_flags.shape == (R, gamma)
    assert v.committed.shape == (R, gamma + 1)
    assert bool(((v.accepted >= 0) & (v.accepted <= gamma)).all())
    assert v.accept_flags.sum(1).tolist() == v.accepted.tolist()
    assert torch.equal(v.num_committed, v.accepted + 1)
    assert torch.equal(v.is_bonus, v.accepted == gamma)
    lists = v.committed_lists()
    for r, row in enumerate(lists):
        n = int(v.accepted[r])
        assert len(row) == n + 1
        assert row[-1] == int(v.next_tokens[r])
        assert all(t >= 0 for t in row)
        assert bool((v.committed[r, n + 1 :] == -1).all()), "padding must be -1"


# --------------------------------------------------------------------------------------------
# Constructor validation names the field
# --------------------------------------------------------------------------------------------


def _block_kwargs(R=2, gamma=3, V=5):
    b = DraftBlock.dummy(R, gamma, V)
    return dict(tokens=b.tokens, q=b.q, valid_lengths=b.valid_lengths, confidence_logits=b.confidence_logits)


@pytest.mark.parametrize(
    "change,exc,pattern",
    [
        (dict(tokens=torch.zeros(2, 3, 1, dtype=torch.long)), ValueError, r"DraftBlock\.tokens must have 2 dimensions"),
        (dict(tokens=torch.zeros(6, dtype=torch.long)), ValueError, r"DraftBlock\.tokens must have 2 dimensions"),
        (dict(tokens=torch.zeros(2, 3)), TypeError, r"DraftBlock\.tokens must be an integer tensor"),
        (dict(tokens=[[0, 1, 2], [0, 1, 2]]), TypeError, r"DraftBlock\.tokens must be a torch\.Tensor"),
        (dict(q=torch.rand(2, 3)), ValueError, r"DraftBlock\.q must have 3 dimensions"),
        (dict(q=torch.rand(2, 4, 5)), ValueError, r"DraftBlock\.q has shape \(2, 4, 5\); expected \[R=2, γ=3, V\]"),
        (dict(q=torch.rand(3, 3, 5)), ValueError, r"DraftBlock\.q has shape"),
        (dict(q=torch.ones(2, 3, 5, dtype=torch.long)), TypeError, r"DraftBlock\.q must be a floating-point"),
        (dict(valid_lengths=torch.tensor([0, 4])), ValueError, r"DraftBlock\.valid_lengths must lie in \[0, γ=3\]"),
        (dict(valid_lengths=torch.tensor([-1, 2])), ValueError, r"DraftBlock\.valid_lengths must lie in"),
        (dict(valid_lengths=torch.tensor([1, 2, 3])), ValueError, r"DraftBlock\.valid_lengths must have shape \[2\]"),
        (dict(valid_lengths=torch.tensor([[1, 2]])), ValueError, r"DraftBlock\.valid_lengths must have 1 dimensions"),
        (dict(confidence_logits=torch.zeros(2, 4)), ValueError, r"DraftBlock\.confidence_logits must have shape \[2, 3\]"),
        (dict(confidence_logits=torch.zeros(2, 3, 1)), ValueError, r"DraftBlock\.confidence_logits must have 2 dimensions"),
        (dict(confidence_logits=torch.zeros(2, 3, dtype=torch.long)), TypeError, r"DraftBlock\.confidence_logits must be a floating-point"),
        (dict(draft_logits=torch.zeros(2, 3, 4)), ValueError, r"DraftBlock\.draft_logits must have the shape of q"),
        (dict(hidden=torch.zeros(2, 2, 8)), ValueError, r"DraftBlock\.hidden must have shape \[2, 3, d\]"),
    ],
)
def test_draft_block_validation_names_the_field(change, exc, pattern):
    kwargs = _block_kwargs() | change
    with pytest.raises(exc, match=pattern):
        DraftBlock(**kwargs)


def test_draft_block_accepts_empty_batch():
    b = DraftBlock(tokens=torch.zeros(0, 3, dtype=torch.long), q=torch.zeros(0, 3, 5),
                   valid_lengths=torch.zeros(0, dtype=torch.long))
    assert b.num_requests == 0 and b.gamma == 3 and b.vocab_size == 5


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(lengths=torch.tensor([[1]]), survival=torch.rand(1, 3)), ValueError, r"Schedule\.lengths must have 1 dimensions"),
        (dict(lengths=torch.tensor([1.0]), survival=torch.rand(1, 3)), TypeError, r"Schedule\.lengths must be an integer"),
        (dict(lengths=torch.tensor([1]), survival=torch.rand(3)), ValueError, r"Schedule\.survival must have 2 dimensions"),
        (dict(lengths=torch.tensor([1, 2]), survival=torch.rand(1, 3)), ValueError, r"Schedule\.survival and Schedule\.lengths disagree on R"),
        (dict(lengths=torch.tensor([4]), survival=torch.rand(1, 3)), ValueError, r"Schedule\.lengths must lie in \[0, γ=3\]"),
        (dict(lengths=torch.tensor([-1]), survival=torch.rand(1, 3)), ValueError, r"Schedule\.lengths must lie in"),
    ],
)
def test_schedule_validation_names_the_field(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        Schedule(expected_tokens=1.0, batch_size=1, **kwargs)


@pytest.mark.parametrize(
    "field_name,bad,exc",
    [
        ("accepted", torch.tensor([[0]]), ValueError),
        ("accepted", torch.tensor([0.0]), TypeError),
        ("accept_flags", torch.zeros(1, 2, dtype=torch.long), TypeError),
        ("accept_flags", torch.zeros(2, dtype=torch.bool), ValueError),
        ("next_tokens", torch.tensor([[1]]), ValueError),
        ("committed", torch.tensor([1, -1, -1]), ValueError),
    ],
)
def test_verify_result_validation_names_the_field(field_name, bad, exc):
    good = dict(accepted=torch.tensor([0]), accept_flags=torch.zeros(1, 2, dtype=torch.bool),
                next_tokens=torch.tensor([1]), is_bonus=torch.tensor([False]),
                committed=torch.tensor([[1, -1, -1]]))
    VerifyResult(**good)
    with pytest.raises(exc, match=rf"VerifyResult\.{field_name} must"):
        VerifyResult(**(good | {field_name: bad}))


def test_sampling_params():
    assert SamplingParams().is_greedy and SamplingParams.greedy().is_greedy
    assert not SamplingParams.random().is_greedy
    with pytest.raises(ValueError, match="temperature > 0"):
        SamplingParams.random(0)
    with pytest.raises(ValueError, match="temperature > 0"):
        SamplingParams.random(0.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


# --------------------------------------------------------------------------------------------
# n-gram drafter
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens,gamma,lo,hi,expected",
    [
        # trailing 1-gram "1" occurs at 0 and 3: the latest (3) wins → follow [9, 1]
        ([1, 5, 6, 1, 9, 1], 4, 1, 1, [9, 1]),
        # gamma truncates the continuation
        ([1, 5, 6, 1, 9, 1], 1, 1, 1, [9]),
        # the longest n-gram is preferred: "2 3" matches at 0 (→ 7 8), while the 1-gram "3" has a
        # later match at 5 (→ 4 2); with max_ngram 2 the bigram match wins
        ([2, 3, 7, 8, 0, 3, 4, 2, 3], 2, 1, 2, [7, 8]),
        ([2, 3, 7, 8, 0, 3, 4, 2, 3], 2, 1, 1, [4, 2]),
        # a 3-gram match beats 2- and 1-gram ones
        ([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 3, 1, 3, [4, 9, 2]),
        ([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 3, 1, 2, [5, 1, 2]),
        # no earlier occurrence of the tail → []
        ([1, 2, 3, 4], 3, 1, 3, []),
        # min_ngram above every match length → []
        ([1, 2, 3, 1, 5, 1], 3, 2, 3, []),
        # a repeated token matches its immediate predecessor, following it with itself
        ([7, 7], 3, 1, 3, [7]),
        ([7, 7, 7, 7], 3, 1, 1, [7]),  # latest match is at index 2 → only one token follows
        ([7, 7, 7, 7], 3, 1, 3, [7]),
        # too short to match / empty
        ([5], 3, 1, 3, []),
        ([], 3, 1, 3, []),
    ],
)
def test_lookup_continuation_hand_checked(tokens, gamma, lo, hi, expected):
    assert lookup_continuation(tokens, gamma, lo, hi) == expected


def test_lookup_continuation_may_run_into_the_tail():
    # "1 2 3 1 2": the 2-gram "1 2" latest earlier match is at 0 → [3, 1, 2]
    assert lookup_continuation([1, 2, 3, 1, 2], 5, 1, 2) == [3, 1, 2]


def _ctx(seqs, max_lengths=None, ids=None):
    ids = ids or [f"r{i}" for i in range(len(seqs))]
    return DraftContext(ids, [torch.tensor(s, dtype=torch.long) for s in seqs],
                        [SamplingParams.greedy()] * len(seqs), max_lengths=max_lengths)


def test_ngram_draft_one_hot_q_matches_tokens():
    drafter = dspark.get_drafter("ngram", vocab_size=10, gamma=4)
    assert isinstance(drafter, NGramDrafter) and drafter.name == "ngram"
    seqs = [[1, 2, 3, 4, 5, 1, 2], [9, 9, 9], [1, 2, 3]]
    block = drafter.draft(_ctx(seqs))
    assert block.tokens.shape == (3, 4) and block.q.shape == (3, 4, 10)
    assert block.valid_lengths.tolist() == [4, 1, 0]
    assert block.tokens[0].tolist() == [3, 4, 5, 1]
    assert block.tokens[1, 0].item() == 9
    assert bool((block.q.sum(-1) == 1).all())
    assert bool(((block.q == 0) | (block.q == 1)).all())
    assert torch.equal(block.q.argmax(-1), block.tokens)
    # confidence: the per-position prior logit(prior_acceptance), independent of the tokens
    assert torch.allclose(block.confidence_logits, torch.zeros(3, 4))
    d2 = NGramDrafter(vocab_size=10, gamma=4, prior_acceptance=0.8)
    assert torch.allclose(d2.draft(_ctx(seqs)).confidence_logits, torch.full((3, 4), math.log(4.0)))


def test_ngram_draft_honours_max_lengths():
    drafter = NGramDrafter(vocab_size=10, gamma=4)
    seqs = [[1, 2, 3, 4, 5, 1, 2]] * 4
    block = drafter.draft(_ctx(seqs, max_lengths=torch.tensor([0, 1, 3, 9])))
    assert block.valid_lengths.tolist() == [0, 1, 3, 4]
    for r, n in enumerate([0, 1, 3, 4]):
        assert block.tokens[r, :n].tolist() == [3, 4, 5, 1][:n]


def test_ngram_window_limits_lookup():
    seq = [1, 8, 2, 3, 4, 5, 1]
    assert NGramDrafter(vocab_size=10, gamma=2).draft(_ctx([seq])).tokens[0].tolist() == [8, 2]
    windowed = NGramDrafter(vocab_size=10, gamma=2, window=4).draft(_ctx([seq]))
    assert windowed.valid_lengths.tolist() == [0]


def test_ngram_token_out_of_vocab_names_the_request():
    drafter = NGramDrafter(vocab_size=8, gamma=2)
    with pytest.raises(ValueError, match=r"request 'req-b' has token id 8 outside the drafter's vocabulary \[0, 8\)"):
        drafter.draft(_ctx([[1, 2, 1], [1, 8, 3]], ids=["req-a", "req-b"]))
    with pytest.raises(ValueError, match=r"request 'req-a' has token id -3 outside"):
        drafter.draft(_ctx([[1, -3, 5, 1]], ids=["req-a"]))


def test_ngram_negative_room_and_ngram_order():
    drafter = NGramDrafter(vocab_size=8, gamma=3)
    ctx = DraftContext(["r"], [torch.tensor([1, 2, 3, 1])], [SamplingParams()], max_lengths=torch.tensor([-1]))
    assert drafter.draft(ctx).valid_lengths.tolist() == [0]
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(vocab_size=8, min_ngram=3, max_ngram=2)


def test_ngram_drafter_config_validation():
    with pytest.raises((TypeError, ValueError)):
        NGramDrafter(vocab_size=0)
    with pytest.raises((TypeError, ValueError)):
        NGramDrafter(vocab_size=10, gamma=0)
    with pytest.raises((TypeError, ValueError)):
        NGramDrafter(vocab_size=10, prior_acceptance=1.0)


def test_draft_context_rejects_empty_sequence_and_mismatched_lengths():
    with pytest.raises(ValueError, match=r"request 'second' has no anchor token"):
        DraftContext(["first", "second"], [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)],
                     [SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"2 request ids but 1 token sequences and 2 sampling params"):
        DraftContext(["a", "b"], [torch.tensor([1])], [SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"1 request ids but 1 token sequences and 2 sampling params"):
        DraftContext(["a"], [torch.tensor([1])], [SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"2 requests but 1 generators"):
        DraftContext(["a", "b"], [torch.tensor([1])] * 2, [SamplingParams()] * 2,
                     generators=[torch.Generator()])


# --------------------------------------------------------------------------------------------
# Confidence models
# --------------------------------------------------------------------------------------------


def test_max_prob_equals_logit_of_max_q():
    block = DraftBlock.dummy(3, 5, 11, seed=4)
    z = dspark.get_confidence_model("max-prob").confidence_logits(block)
    assert z.shape == (3, 5)
    torch.testing.assert_close(z, torch.logit(block.q.amax(-1)))
    torch.testing.assert_close(torch.sigmoid(z), block.q.amax(-1))


def test_max_prob_is_clamped_on_one_hot_q():
    q = torch.nn.functional.one_hot(torch.tensor([[0, 2]]), 3).float()
    z = max_prob_logits(q)
    assert bool(torch.isfinite(z).all())
    # clamped to 1 - eps in fp32 (1 - 1e-6 rounds), so ≈ logit(1 - 1e-6) ≈ 13.8, not +inf
    torch.testing.assert_close(z, torch.full((1, 2), math.log((1 - 1e-6) / 1e-6)), rtol=2e-3, atol=0)


@pytest.mark.parametrize("name", ["max-prob", "draft-head"])
def test_confidence_never_depends_on_the_sampled_token(name):
    """Two blocks identical except for x̂ must get the same logits (the stopping-rule property)."""
    model = dspark.get_confidence_model(name)
    a = DraftBlock.dummy(4, 6, 9, seed=2, with_confidence=False)
    other = (a.tokens + 1 + torch.arange(a.tokens.numel()).reshape(a.tokens.shape) % 7) % 9
    assert not torch.equal(other, a.tokens)
    b = DraftBlock(tokens=other, q=a.q, valid_lengths=a.valid_lengths)
    torch.testing.assert_close(model.confidence_logits(a), model.confidence_logits(b), rtol=0, atol=0)


def test_draft_head_passes_through_and_falls_back_to_max_prob():
    head = DraftHeadConfidence()
    block = DraftBlock.dummy(2, 3, 6, seed=5)
    assert head.confidence_logits(block) is block.confidence_logits
    bare = DraftBlock.dummy(2, 3, 6, seed=5, with_confidence=False)
    torch.testing.assert_close(head.confidence_logits(bare), MaxProbConfidence().confidence_logits(bare))
    assert dspark.get_confidence_model("draft-head").name == "draft-head"


def test_head_max_prob_is_its_formula_and_never_reads_the_sampled_token():
    """logit c_j = w_j·z_head + v_j·logit(max softmax(Ũ_j)) + b_j per position, computed here by hand."""
    from dspark.confidence import HeadMaxProbConfidence

    W = [[0.5, 1.0, -0.2], [1.0, 0.0, 0.3], [0.0, 2.0, 0.0], [0.7, 0.7, 0.7]]
    model = dspark.get_confidence_model("head-max-prob", weights=W)
    a = DraftBlock.dummy(3, 4, 9, seed=6)
    want = torch.empty(3, 4)
    for j, (w, v, b) in enumerate(W):
        m = torch.softmax(a.draft_logits[:, j].float(), -1).amax(-1)  # [R]
        want[:, j] = w * a.confidence_logits[:, j] + v * torch.log(m / (1 - m)) + b
    torch.testing.assert_close(model.confidence_logits(a), want, rtol=1e-5, atol=1e-5)
    other = DraftBlock(tokens=(a.tokens + 1) % 9, q=a.q, valid_lengths=a.valid_lengths,
                       confidence_logits=a.confidence_logits, draft_logits=a.draft_logits)
    torch.testing.assert_close(model.confidence_logits(other), model.confidence_logits(a), rtol=0, atol=0)
    assert HeadMaxProbConfidence(W) == model


def test_head_max_prob_errors_name_the_problem(tmp_path):
    from dspark.confidence import HeadMaxProbConfidence

    model = HeadMaxProbConfidence([[1.0, 1.0, 0.0]] * 3)
    with pytest.raises(ValueError, match="fitted for γ = 3 draft positions; the drafter proposes 4"):
        model.confidence_logits(DraftBlock.dummy(2, 4, 5))
    with pytest.raises(ValueError, match="needs a drafter with a confidence head"):
        model.confidence_logits(DraftBlock.dummy(2, 3, 5, with_confidence=False))
    with pytest.raises(ValueError, match=r"one finite \[w_head, w_maxprob, bias\] row per draft position"):
        HeadMaxProbConfidence([[1.0, 2.0]])
    with pytest.raises(ValueError, match="exactly one"):
        dspark.get_confidence_model("head-max-prob")
    bad = tmp_path / "confidence.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        dspark.get_confidence_model("head-max-prob", path=bad)
    bad.write_text('{"name": "sts", "weights": []}')
    with pytest.raises(ValueError, match="not a head-max-prob confidence file"):
        HeadMaxProbConfidence.load(bad)
    with pytest.raises(ValueError, match="cannot read"):
        HeadMaxProbConfidence.load(tmp_path / "missing.json")
    model.save(bad, drafter="x")
    assert HeadMaxProbConfidence.load(bad) == model


def test_fit_head_max_prob_recovers_the_weights_that_made_the_rounds():
    """Rounds drawn from a known stacked model (each position accepted with σ(w·x) until the first
    rejection): the per-position fit over the rounds at risk recovers w."""
    from dspark.confidence import fit_head_max_prob

    g = torch.Generator().manual_seed(0)
    N, gamma = 40_000, 3
    truth = torch.tensor([[1.0, 0.5, 0.2], [0.3, 1.2, -0.3], [0.8, 0.8, 0.5]], dtype=torch.float64)
    zh = torch.randn(N, gamma, generator=g, dtype=torch.float64)
    zp = 0.5 * zh + torch.randn(N, gamma, generator=g, dtype=torch.float64)  # correlated, as in real rounds
    p = torch.sigmoid(truth[:, 0] * zh + truth[:, 1] * zp + truth[:, 2])  # [N, γ] conditional acceptance
    ok = torch.rand(N, gamma, generator=g, dtype=torch.float64) < p
    accepted = ok.long().cumprod(1).sum(1)  # [N] positions accepted before the first rejection
    fitted = fit_head_max_prob(zh.float(), zp.float(), accepted, torch.full((N,), gamma), l2=0.0)
    torch.testing.assert_close(torch.tensor(fitted.weights, dtype=torch.float64), truth, atol=0.08, rtol=0)
    with pytest.raises(ValueError, match="one shape"):
        fit_head_max_prob(zh, zp[:, :2], accepted)


def test_stacked_features_are_their_formulas_by_hand():
    """head, logit max_v q, log q(1st) − log q(2nd), Σ q log q, logit of the top-5 mass of
    softmax(Ũ_j), computed here with sorting; none reads the drafted token."""
    from dspark.confidence import confidence_features

    a = DraftBlock.dummy(3, 4, 9, seed=7)
    names = ["head", "max-prob", "margin", "neg-entropy", "top5-mass"]
    got = confidence_features(a, names)  # [R, γ, 5]
    q = torch.softmax(a.draft_logits.double(), -1)  # [R, γ, V]
    srt = q.sort(-1, descending=True).values
    want = torch.stack([a.confidence_logits.double(), torch.log(srt[..., 0] / (1 - srt[..., 0])),
                        torch.log(srt[..., 0] / srt[..., 1]), (q * q.log()).sum(-1),
                        torch.log(srt[..., :5].sum(-1) / (1 - srt[..., :5].sum(-1)))], -1)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    other = DraftBlock(tokens=(a.tokens + 1) % 9, q=a.q, valid_lengths=a.valid_lengths,
                       confidence_logits=a.confidence_logits, draft_logits=a.draft_logits)
    torch.testing.assert_close(confidence_features(other, names), got, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown confidence feature"):
        confidence_features(a, ["head", "vibes"])
    with pytest.raises(ValueError, match="needs a drafter with a confidence head"):
        confidence_features(DraftBlock.dummy(2, 3, 5, with_confidence=False), ["head"])


def test_fit_stacked_recovers_a_quadratic_model_and_round_trips(tmp_path):
    """Rounds drawn from a known per-position logit quadratic in two features: fit_stacked (with
    squares) predicts the true conditional acceptance closely, the linear fit does not; save/load and
    the registered factory give the same model; bad files and shapes fail naming the problem."""
    from dspark.confidence import StackedConfidence, fit_stacked

    g = torch.Generator().manual_seed(1)
    N, gamma = 30_000, 2
    X = torch.randn(N, gamma, 2, generator=g, dtype=torch.float64)
    z = 0.8 * X[..., 0] + 0.4 * X[..., 1] - 0.6 * X[..., 0] ** 2 + 0.5  # [N, γ]
    ok = torch.rand(N, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(z)
    accepted = ok.long().cumprod(1).sum(1)
    quad = fit_stacked(X, accepted, features=["head", "max-prob"], l2=0.0)
    lin = fit_stacked(X, accepted, features=["head", "max-prob"], squares=False, l2=0.0)
    err_q = (torch.sigmoid(quad.apply(X).double()) - torch.sigmoid(z)).abs().mean()
    err_l = (torch.sigmoid(lin.apply(X).double()) - torch.sigmoid(z)).abs().mean()
    assert err_q < 0.02 < err_l
    quad.save(tmp_path / "c.json", drafter="x")
    assert StackedConfidence.load(tmp_path / "c.json") == quad
    assert dspark.get_confidence_model("stacked", path=tmp_path / "c.json") == quad
    assert quad.calibrated
    with pytest.raises(ValueError, match="one column per feature"):
        fit_stacked(X[..., :1], accepted, features=["head", "max-prob"])
    with pytest.raises(ValueError, match="fitted for γ = 2 draft positions and 2 features"):
        quad.apply(X[:, :1])
    with pytest.raises(ValueError, match="each weights row needs 5 entries"):
        StackedConfidence(["head", "max-prob"], [[0.0] * 4], [0, 0], [1, 1])
    (tmp_path / "c.json").write_text('{"name": "stacked", "features": ["head"]}')
    with pytest.raises(ValueError, match="needs 'weights'"):
        StackedConfidence.load(tmp_path / "c.json")


# --------------------------------------------------------------------------------------------
# Model loading errors
# --------------------------------------------------------------------------------------------


def test_load_missing_folder_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match=r"model 'no/such/dir' is neither 'smollm2-135m', a local HF folder nor a \.gguf file"):
        load_causal_lm("no/such/dir")


def test_load_missing_gguf_is_a_clear_error(tmp_path):
    missing = tmp_path / "nothing.gguf"
    with pytest.raises(FileNotFoundError, match=r"GGUF file .*nothing\.gguf does not exist"):
        load_causal_lm(str(missing))


def test_cli_demo_with_missing_model_exits_2(capsys, tmp_path):
    from dspark.cli import main

    assert main(["demo", "--target", str(tmp_path / "absent"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "dspark demo: error:" in err and "neither" in err


def test_cli_demo_with_a_missing_prompt_file_exits_2_before_loading_a_model(capsys, tmp_path):
    from dspark.cli import main

    # the model path is missing too: the prompt file is checked first, so its error is the one shown
    assert main(["demo", "--prompts", str(tmp_path / "none.jsonl"), "--target", str(tmp_path / "absent"),
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "dspark demo: error: prompt file" in err and "none.jsonl does not exist" in err


def test_load_causal_lm_rejects_a_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an HF model folder"):
        load_causal_lm(str(tmp_path))
