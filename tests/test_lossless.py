"""Statistical losslessness: committed tokens follow the target's distribution, for every scheduler.

Joint distributions of the first three generated tokens are compared with the exact Markov
target by a χ² test at fixed seeds (p-value threshold 1e-3). Cases: q far from p, q with zeros
where p > 0, q = p; temperatures with top-k / top-p, and greedy.
"""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

import dspark
from _sim import exact_joint, simulate
from dspark.cost_models import SPSTableCostModel
from dspark.schedulers import LossyScheduleWarning, with_sunk_seconds
from dspark.types import SamplingParams
from helpers import chi2_pvalue, sequence_counts

V, GAMMA, N_TOK = 4, 3, 3

CPU_LIKE = SPSTableCostModel.from_points(
    {1: 0.054, 4: 0.06, 8: 0.085, 16: 0.108, 32: 0.166}, accounting="packed"
)


def _tables(case: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 1.5
    conf = torch.randn(V, generator=g) * 2.0  # c_j depends on x̂_{j-1}
    if case == "far":
        draft = torch.randn(V, V, generator=g) * 2.5
    elif case == "zeros":  # q has zeros where p > 0
        draft = target.clone()
        draft[:, 1] = float("-inf")
    elif case == "equal":
        draft = target.clone()
    else:
        raise ValueError(case)
    return target, draft, conf


SCHEDULERS = {
    "full": lambda: dspark.get_scheduler("full"),
    "fixed-1": lambda: dspark.get_scheduler("fixed", k=1),
    "threshold-step": lambda: dspark.get_scheduler("threshold", threshold=0.5),
    "threshold-survival": lambda: dspark.get_scheduler("threshold", threshold=0.3, mode="survival"),
    "sps-greedy": lambda: dspark.get_scheduler("sps-greedy"),
    "sps-greedy-async": lambda: dspark.get_scheduler("sps-greedy", lag=2),
    "sps-greedy-sunk": lambda: dspark.get_scheduler("sps-greedy", sunk=True),  # sees a 100 ms draft
}


def _cost_for(scheduler):
    """CPU_LIKE, wrapped with 100 ms already spent for a scheduler that counts them (the round's
    drafting time: what ``speculative_round`` passes). 100 ms, about two CPU_LIKE steps, so that
    the schedules really differ: mean ℓ 0.18 → 1.26 ("far", T = 1) against the paper's Θ."""
    return with_sunk_seconds(scheduler, CPU_LIKE, 0.1)
PARAMS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7-topk3": SamplingParams(temperature=0.7, top_k=3),
    "T1.3-topp0.8": SamplingParams(temperature=1.3, top_p=0.8),
}


@pytest.mark.parametrize("sched", SCHEDULERS)
@pytest.mark.parametrize("case", ["far", "zeros", "equal"])
@pytest.mark.parametrize("pname", PARAMS)
def test_committed_tokens_follow_target(sched, case, pname):
    target, draft, conf = _tables(case)
    params = PARAMS[pname]
    tokens, st = simulate(
        target, draft, conf, params, (sch := SCHEDULERS[sched]()), _cost_for(sch),
        n_trials=6000, n_tokens=N_TOK, gamma=GAMMA, seed=zlib.crc32(f"{sched}/{case}/{pname}".encode()),  # stable across processes
    )
    pvalue = chi2_pvalue(sequence_counts(tokens, V), exact_joint(target, params, N_TOK))
    assert pvalue > 1e-3, f"{sched}/{case}/{pname}: χ² p = {pvalue:.2e} (τ = {st['tau']:.2f})"
    assert st["tau"] >= 1.0


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_greedy_output_is_the_target_greedy_chain(sched):
    target, draft, conf = _tables("far", seed=1)
    tokens, _ = simulate(
        target, draft, conf, SamplingParams.greedy(), (sch := SCHEDULERS[sched]()), _cost_for(sch),
        n_trials=16, n_tokens=6, gamma=GAMMA,
    )
    expected, prev = [], 0
    for _ in range(6):
        prev = int(target[prev].argmax())
        expected.append(prev)
    assert (tokens == torch.tensor(expected)).all()


def _counterexample():
    """DESIGN.md §3: a (0.7, 0.3) target, a (0.5, 0.5) drafter, and a confidence at position 2
    that is high after x̂_1 = A and low after x̂_1 = B. Token 2 is the start anchor S."""
    log = torch.log
    target = log(torch.tensor([[0.7, 0.3, 1e-30]] * 3))
    draft = log(torch.tensor([[0.5, 0.5, 1e-30]] * 3))
    conf = torch.logit(torch.tensor([0.99, 0.01, 0.5]))  # after A, after B, after S
    # Θ(ℓ=1) < Θ(ℓ=0) < Θ(ℓ=2 | x̂_1 = A): only a look-ahead schedule verifies after seeing x̂_1.
    cost = SPSTableCostModel.from_points({1: 1.0, 2: 1.6, 3: 1.7}, accounting="packed", extrapolate="clamp")
    return target, draft, conf, cost


def _first_token_freq(scheduler, seed=0, n=20000):
    target, draft, conf, cost = _counterexample()
    tokens, _ = simulate(
        target, draft, conf, SamplingParams(temperature=1.0), scheduler, cost,
        n_trials=n, n_tokens=1, gamma=2, group=1, start=2, seed=seed,
    )
    return float((tokens[:, 0] == 0).float().mean()), tokens


def test_sps_argmax_is_biased_on_the_counterexample_and_sps_greedy_is_not():
    with pytest.warns(LossyScheduleWarning, match="NOT lossless"):
        lossy = dspark.get_scheduler("sps-argmax")
    assert lossy.lossless is False
    p_a_lossy, _ = _first_token_freq(lossy)
    assert abs(p_a_lossy - 0.85) < 0.015, p_a_lossy  # the paper's (0.85, 0.15)
    p_a, tokens = _first_token_freq(dspark.get_scheduler("sps-greedy"))
    assert abs(p_a - 0.7) < 0.015, p_a
    target = _counterexample()[0]
    assert chi2_pvalue(sequence_counts(tokens, 3), exact_joint(target, SamplingParams(temperature=1.0), 1, start=2)) > 1e-3


def test_sps_argmax_fails_the_general_chi2_test():
    """The same χ² harness that passes every lossless scheduler detects the look-ahead bias."""
    target, draft, conf, cost = _counterexample()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyScheduleWarning)
        lossy = dspark.get_scheduler("sps-argmax")
    params = SamplingParams(temperature=1.0)
    tokens, _ = simulate(target, draft, conf, params, lossy, cost, n_trials=6000,
                         n_tokens=1, gamma=2, group=1, start=2)
    assert chi2_pvalue(sequence_counts(tokens, 3), exact_joint(target, params, 1, start=2)) < 1e-6


def test_harness_detects_greedy_drafts_verified_as_sampled():
    """Power check: drafting greedily at T > 0 while verifying against the sampled q is lossy."""
    target, draft, conf = _tables("far")
    params = SamplingParams(temperature=1.0)
    tokens, _ = simulate(target, draft, conf, params, dspark.get_scheduler("full"), CPU_LIKE,
                         n_trials=6000, n_tokens=N_TOK, gamma=GAMMA, greedy_draft_bug=True)
    assert chi2_pvalue(sequence_counts(tokens, V), exact_joint(target, params, N_TOK)) < 1e-6
