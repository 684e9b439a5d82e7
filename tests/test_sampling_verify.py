"""Sampling transforms and the rejection sampler, on hand-checkable cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.sampling import greedy_argmax, probs_from_logits, sample
from dspark.types import SamplingParams
from dspark.verify import residual_distribution, verify, verify_greedy


def test_greedy_probs_are_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    p = probs_from_logits(logits, temperature=0.0)
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def _first_index_of_max(row: list[float]) -> int:
    """The oracle: a plain loop, keeping the first index of the largest value."""
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [3, 17, 14086, 49152])
def test_greedy_argmax_is_the_first_index_of_the_largest_logit(dtype, V):
    """Random rows, rows whose maximum repeats at 2–5 places far apart (so the tie spans the
    reduction's vector lanes and chunks), all-equal rows and rows of −inf but one finite entry."""
    gen = torch.Generator().manual_seed(V)
    rows = [torch.randn(V, generator=gen) for _ in range(4)]
    for k in (2, 3, 5):
        row = torch.randn(V, generator=gen)
        at = torch.randperm(V, generator=gen)[: min(k, V)]
        row[at] = row.max() + 1.0
        rows.append(row)
    rows.append(torch.full((V,), 0.25))
    lone = torch.full((V,), float("-inf"))
    lone[V // 2] = -3.0
    rows.append(lone)
    logits = torch.stack(rows).to(dtype)  # [n, V]
    want = [_first_index_of_max(r.float().tolist()) for r in logits]
    assert greedy_argmax(logits).tolist() == want
    assert greedy_argmax(logits.reshape(3, -1, V)).tolist() == torch.tensor(want).reshape(3, -1).tolist()  # [..., V]


def test_temperature_top_k_top_p_per_request():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    T = torch.tensor([1.0, 1.0, 1.0])
    k = torch.tensor([2, 0, 0])
    top_p = torch.tensor([1.0, 0.8, 1.0])
    p = probs_from_logits(logits, T, k, top_p)
    torch.testing.assert_close(p[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # nucleus 0.8: mass before token 3 is 0.8 ≥ 0.8 → dropped; token 2 (mass before 0.5) kept
    torch.testing.assert_close(p[1], torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    torch.testing.assert_close(p[2], torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.log(torch.tensor([[0.9, 0.1]]))
    p = probs_from_logits(logits, 1.0, 0, 0.01)
    assert torch.equal(p, torch.tensor([[1.0, 0.0]]))


def test_sample_matches_distribution_and_respects_per_request_generators():
    probs = torch.tensor([[0.2, 0.5, 0.3]]).expand(20000, 3)
    counts = torch.bincount(sample(probs, torch.Generator().manual_seed(1)), minlength=3)
    torch.testing.assert_close(counts / 20000, torch.tensor([0.2, 0.5, 0.3]), atol=0.015, rtol=0)
    # A request's draw depends only on its own generator, not on its neighbours.
    p2 = torch.tensor([[0.2, 0.5, 0.3], [0.9, 0.05, 0.05]])
    a = sample(p2, [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)])
    b = sample(p2[:1], [torch.Generator().manual_seed(7)])
    assert a[0] == b[0]


def test_sampling_params_validation_messages():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        SamplingParams(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        SamplingParams(temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(temperature=float("nan"))


def test_residual_distribution():
    p = torch.tensor([0.7, 0.3, 0.0])
    q = torch.tensor([0.5, 0.4, 0.1])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    # p == q: rejection impossible, fallback is p itself
    torch.testing.assert_close(residual_distribution(p, p), p)


def _one_hot(idx, V):
    return torch.nn.functional.one_hot(torch.as_tensor(idx), V).float()


def test_verify_ragged_lengths_and_committed_layout():
    V = 5
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 4, 4]])
    q = _one_hot(draft, V)  # deterministic drafts
    target_tokens = torch.tensor([[1, 2, 0, 4], [1, 2, 3, 0], [1, 2, 3, 0], [0, 1, 2, 3]])
    p = _one_hot(target_tokens, V)  # [R, γ+1, V]
    lengths = torch.tensor([3, 3, 1, 0])
    res = verify(draft, q, p, lengths, torch.Generator().manual_seed(0))
    assert res.accepted.tolist() == [2, 3, 1, 0]
    assert res.next_tokens.tolist() == [0, 0, 2, 0]
    assert res.is_bonus.tolist() == [False, True, True, True]
    assert res.committed_lists() == [[1, 2, 0], [1, 2, 3, 0], [1, 2], [0]]
    assert res.accept_flags.tolist()[0] == [True, True, False]
    g = verify_greedy(draft, target_tokens, lengths)
    assert torch.equal(g.committed, res.committed)
    assert torch.equal(g.accepted, res.accepted)


def test_verify_rejects_bad_shapes():
    blk_tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="γ \\+ 1"):
        verify_greedy(blk_tokens, torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="lengths"):
        verify_greedy(blk_tokens, torch.zeros(2, 4, dtype=torch.long), torch.tensor([1, 4]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(2, 7), st.integers(0, 2**31 - 1))
def test_greedy_verify_equals_rejection_sampler_with_one_hot_p(R, gamma, V, seed):
    """T = 0 is the limit of the stochastic rule: both functions agree exactly for any q."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(R, gamma, V, generator=g) * 3, -1)
    draft = q.argmax(-1)
    target_argmax = torch.randint(0, V, (R, gamma + 1), generator=g)
    # make some drafts match so accepted prefixes are non-trivial
    match = torch.rand(R, gamma, generator=g) < 0.6
    target_argmax[:, :gamma] = torch.where(match, draft, target_argmax[:, :gamma])
    lengths = torch.randint(0, gamma + 1, (R,), generator=g)
    a = verify_greedy(draft, target_argmax, lengths)
    b = verify(draft, q, _one_hot(target_argmax, V), lengths, g)
    assert torch.equal(a.committed, b.committed)
    assert torch.equal(a.accept_flags, b.accept_flags)
    assert bool((a.accepted <= lengths).all())


def test_verify_single_position_acceptance_rate_is_overlap():
    """P(accept) = Σ min(p, q) and the committed token ~ p, q with zeros where p > 0."""
    N, V = 40000, 4
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q1 = torch.tensor([0.5, 0.5, 0.0, 0.0])
    g = torch.Generator().manual_seed(3)
    draft = torch.multinomial(q1, N, replacement=True, generator=g)[:, None]  # [N, 1]
    q = q1.expand(N, 1, V)
    p = torch.stack([p1, p1]).expand(N, 2, V)
    res = verify(draft, q, p, torch.ones(N, dtype=torch.long), g)
    overlap = torch.minimum(p1, q1).sum()
    assert abs(float(res.accepted.float().mean()) - float(overlap)) < 0.01
    first = res.committed[:, 0]
    freq = torch.bincount(first, minlength=V) / N
    torch.testing.assert_close(freq, p1, atol=0.01, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partial_sort_filter_equals_the_full_sort(seed):
    """The top-k / nucleus filter on the 1024 leading logits (with a full-sort fallback for rows
    whose nucleus reaches past them) keeps exactly the tokens a full sort keeps."""
    from dspark.sampling import _filter_sorted, _filter_top_k_top_p

    g = torch.Generator().manual_seed(seed)
    R, n, V = 6, 3, 5000
    scale = torch.tensor([8.0, 3.0, 0.3, 0.05, 2.0, 1.0])  # peaked … nearly flat (nucleus > 1024)
    x = torch.randn(R, n, V, generator=g) * scale[:, None, None]
    k = torch.tensor([0, 50, 0, 0, 2000, 0])  # no top-k, inside the head, beyond it
    top_p = torch.tensor([0.95, 0.9, 0.99, 0.9, 0.8, 1.0])  # the last row: no filter at all
    k_eff = torch.where((k > 0) & (k < V), k, V)
    fast, full = _filter_top_k_top_p(x, k, top_p), _filter_sorted(x, k_eff, top_p)
    assert torch.equal(torch.isinf(fast), torch.isinf(full))
    kept = ~torch.isinf(full)
    assert torch.equal(fast[kept], x[kept])
    assert int(kept[3].sum(-1).min()) > 1024  # the flat row really took the fallback
    assert torch.equal(fast[5], x[5])  # top_k = 0, top_p = 1 in a filtered batch: untouched


def test_sample_never_draws_zero_mass_not_even_from_a_zero_uniform(monkeypatch):
    import dspark.sampling as sampling

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]])
    counts = torch.bincount(sample(probs.expand(40000, 6), torch.Generator().manual_seed(3)), minlength=6)
    assert counts[[0, 2, 4, 5]].sum() == 0
    torch.testing.assert_close(counts[[1, 3]] / 40000, torch.tensor([0.25, 0.75]), atol=0.01, rtol=0)
    # U = 0 gives E = 0 before the floor: p / 0 would be inf for every token with mass and
    # 0 / 0 = NaN (argmax's maximum) for those without
    monkeypatch.setattr(sampling, "uniform", lambda R, n, g: torch.zeros(R, n))
    assert sample(probs.expand(3, 6)).tolist() == [3, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_accept_equals_matching_every_position_by_hand(dtype):
    """dspark.round.accept (greedy) reads only the positions some request verifies; the oracle walks
    each request's drafts against the target's argmax at every position, in plain Python."""
    from dspark.round import accept
    from dspark.types import DraftBlock

    g = torch.Generator().manual_seed(7)
    R, gamma, V = 5, 6, 11
    for trial in range(60):
        logits = torch.randn(R, gamma + 1, V, generator=g).to(dtype)
        best = logits.float().argmax(-1)  # [R, γ+1]
        # drafts that agree with the target for a random prefix, then (mostly) disagree
        agree = torch.randint(0, gamma + 1, (R,), generator=g)
        tokens = torch.where(torch.arange(gamma)[None] < agree[:, None], best[:, :gamma],
                             torch.randint(0, V, (R, gamma), generator=g))
        lengths = torch.randint(0, gamma + 1, (R,), generator=g)
        if trial % 7 == 0:
            lengths.zero_()  # a round that verifies no draft (ℓ = 0 everywhere)
        block = DraftBlock(tokens, torch.zeros(R, gamma, V), torch.full((R,), gamma))
        accepted, committed = accept(block, logits, lengths, [SamplingParams.greedy()] * R, None)
        for r in range(R):
            n = 0
            while n < int(lengths[r]) and int(tokens[r, n]) == int(best[r, n]):
                n += 1
            want = [int(t) for t in tokens[r, :n]] + [int(best[r, n])]
            assert int(accepted[r]) == n
            assert committed[r].tolist() == want + [-1] * (gamma + 1 - len(want))
