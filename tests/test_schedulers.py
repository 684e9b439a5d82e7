"""Scheduler properties (hypothesis) and behaviour at low load and saturation.

Expected values are recomputed longhand from the definitions (docs/concepts.md §2–4, the ``Schedule``
docstring), never with ``dspark.schedulers.summarise`` / ``survival``, which the schedulers
themselves use; sps-greedy is also checked against a brute force over every lengths vector.
"""

from __future__ import annotations

import itertools
import math
import warnings
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dspark
from dspark.cost_models import SPSTableCostModel
from dspark.schedulers import LossyScheduleWarning, SunkCost, with_sunk_seconds

# --------------------------------------------------------------------------------------------
# The oracle: τ, B, Θ written out from the definitions
# --------------------------------------------------------------------------------------------


def oracle_survival(c, valid) -> list[list[float]]:
    """a_{r,j} = Π_{i≤j} c_{r,i} for j ≤ valid_r (1-based j), 0 beyond (docs/concepts.md §2)."""
    a = []
    for r, row in enumerate(c):
        prod, out = 1.0, []
        for j, cj in enumerate(row):
            prod *= float(cj)
            out.append(prod if j < int(valid[r]) else 0.0)
        a.append(out)
    return a


def oracle_tau(c, lengths) -> float:
    """τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}), a_{r,j} = Π_{i≤j} c_{r,i}."""
    tau = 0.0
    for r, ell in enumerate(lengths):
        tau += 1.0
        prod = 1.0
        for j in range(int(ell)):
            prod *= float(c[r][j])
            tau += prod
    return tau


def oracle_batch(lengths, accounting: str) -> int:
    """B_packed = Σ_r (1 + ℓ_r), B_padded = R · (1 + max_r ℓ_r) (docs/concepts.md §4)."""
    lengths = [int(x) for x in lengths]
    if accounting == "packed":
        return sum(1 + ell for ell in lengths)
    assert accounting == "padded", accounting
    return len(lengths) * (1 + max(lengths))


def oracle_theta(c, lengths, cm) -> float:
    """Θ = τ / (t(B) + α(R)) = τ · SPS(B) without a per-request overhead α (docs/concepts.md §4)."""
    R = len(lengths)
    if cm.accounting in ("packed", "padded"):
        B = oracle_batch(lengths, cm.accounting)
    else:  # a plugin accounting: only its cost model knows B
        B = cm.batch_size(torch.tensor([int(x) for x in lengths]))
    step = 1.0 / float(cm.sps(torch.tensor([B]))[0])
    overhead = getattr(cm, "batch_overhead_seconds", lambda _r: 0.0)(R)
    return oracle_tau(c, lengths) / (step + overhead)


def affine(t0: float, slope: float, accounting: str = "packed", top: int = 4096):
    return SPSTableCostModel.from_points({1: t0 + slope, top: t0 + slope * top}, accounting=accounting)


@st.composite
def batches(draw):
    R = draw(st.integers(1, 24))
    gamma = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(R, gamma, generator=g) ** draw(st.sampled_from([0.1, 0.5, 1.0, 3.0]))
    valid = torch.randint(0, gamma + 1, (R,), generator=g)
    return c, valid


COSTS = {
    "flat": affine(0.05, 0.0),
    "cpu": dspark.get_cost_model("sps-table", accounting="packed"),
    "cpu-padded": dspark.get_cost_model("sps-table"),
    "steep": affine(0.0, 0.01),
    "staircase": SPSTableCostModel.from_points({8: 0.02, 16: 0.03, 32: 0.05, 64: 0.09}, interpolation="step"),
}
SCHEDULERS = [("full", {}), ("fixed", {"k": 2}), ("threshold", {"threshold": 0.6}),
              ("threshold", {"threshold": 0.3, "mode": "survival"}), ("sps-greedy", {})]


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(sorted(COSTS)), st.sampled_from(range(len(SCHEDULERS))))
def test_schedule_invariants(batch, cost_name, idx):
    c, valid = batch
    name, cfg = SCHEDULERS[idx]
    cm = COSTS[cost_name]
    sch = dspark.get_scheduler(name, **cfg).schedule(c, valid, cm)
    R, gamma = c.shape
    assert sch.lengths.shape == (R,)
    assert bool((sch.lengths >= 0).all()) and bool((sch.lengths <= valid).all())
    cl, lengths = c.tolist(), sch.lengths.tolist()
    torch.testing.assert_close(sch.survival, torch.tensor(oracle_survival(cl, valid.tolist())).reshape(R, gamma))
    tau = oracle_tau(cl, lengths)
    assert math.isclose(sch.expected_tokens, tau, rel_tol=1e-5, abs_tol=1e-5)
    B = oracle_batch(lengths, cm.accounting)
    assert sch.batch_size == B and cm.batch_size(sch.lengths) == B
    assert math.isclose(sch.expected_throughput, oracle_theta(cl, lengths, cm), rel_tol=1e-5)
    assert tau >= R


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(sorted(COSTS)))
def test_sps_greedy_is_a_greedy_optimum_never_below_plain_decoding(batch, cost_name):
    """The documented rule (docs/concepts.md §5), checked longhand: the admitted candidates are the
    first K of all valid (r, j) sorted by a descending (stably, flat index r·γ + j), every one of
    those admissions raised Θ, and the next candidate would not have. (A former check here,
    a_{r,ℓ_r} ≥ a_{r,ℓ_r+1}, could not fail: survival never increases along a request.)"""
    c, valid = batch
    cm = COSTS[cost_name]
    sch = dspark.get_scheduler("sps-greedy").schedule(c, valid, cm)
    R, gamma = c.shape
    cl = c.tolist()
    plain = oracle_theta(cl, [0] * R, cm)
    assert sch.expected_throughput >= plain * (1 - 1e-9)
    a = sch.survival.tolist()
    order = sorted(((r, j) for r in range(R) for j in range(int(valid[r]))), key=lambda rj: (-a[rj[0]][rj[1]], rj))
    K = int(sch.lengths.sum())
    admitted = [0] * R
    for r, _ in order[:K]:
        admitted[r] += 1
    # Not just prefixes: the admitted set is a survival threshold over the whole batch.
    assert admitted == sch.lengths.tolist(), f"admitted {sch.lengths.tolist()}, the first K={K} by a: {admitted}"
    lengths, theta = [0] * R, plain
    for k, (r, _) in enumerate(order):
        lengths[r] += 1
        nxt = oracle_theta(cl, lengths, cm)
        if k < K:
            assert nxt >= theta * (1 - 1e-9), f"admission {k + 1} lowered Θ: {theta} → {nxt}"
        else:
            assert nxt <= theta * (1 + 1e-9), f"stopped at K={K} although the next admission raises Θ: {theta} → {nxt}"
            break
        theta = nxt


@settings(max_examples=100, deadline=None)
@given(batches(), st.floats(0.0, 0.02), st.floats(1.0, 20.0))
def test_budget_shrinks_as_sps_steepens(batch, slope, factor):
    c, valid = batch
    gentle = dspark.get_scheduler("sps-greedy").schedule(c, valid, affine(0.05, slope))
    steep = dspark.get_scheduler("sps-greedy").schedule(c, valid, affine(0.05, slope * factor))
    assert steep.batch_size <= gentle.batch_size
    assert bool((steep.lengths <= gentle.lengths).all())


def test_low_load_verifies_everything_with_positive_survival():
    c = torch.tensor([[0.9, 0.8, 0.1, 0.5], [0.99, 0.0, 0.9, 0.9]])
    sch = dspark.get_scheduler("sps-greedy").schedule(c, cost_model=COSTS["flat"])
    assert sch.lengths.tolist() == [4, 1]


def test_saturation_falls_back_to_mtp1_then_plain_decoding():
    g = torch.Generator().manual_seed(0)
    c = 0.6 + 0.4 * torch.rand(128, 7, generator=g)
    cpu = COSTS["cpu"]  # knee: 108 ms at 16, 609 ms at 128 tokens
    assert dspark.get_scheduler("sps-greedy").schedule(c[:2], cost_model=cpu).lengths.min() >= 3
    busy = dspark.get_scheduler("sps-greedy").schedule(c[:64], cost_model=cpu)
    assert int(busy.lengths.max()) <= 1
    # Step time proportional to B: nothing beats plain decoding.
    prop = affine(0.0, 0.01)
    assert int(dspark.get_scheduler("sps-greedy").schedule(c, cost_model=prop).lengths.sum()) == 0


def test_padded_accounting_prices_the_longest_prefix():
    c = torch.tensor([[0.95] * 4, [0.2] * 4])
    packed = dspark.get_scheduler("sps-greedy").schedule(c, cost_model=affine(0.05, 0.01, "packed"))
    padded = dspark.get_scheduler("sps-greedy").schedule(c, cost_model=affine(0.05, 0.01, "padded"))
    assert padded.batch_size == 2 * (1 + int(padded.lengths.max()))
    assert packed.batch_size == 2 + int(packed.lengths.sum())


def test_threshold_modes_and_fixed():
    c = torch.tensor([[0.9, 0.7, 0.9, 0.9]])
    assert dspark.get_scheduler("threshold", threshold=0.8).schedule(c).lengths.tolist() == [1]
    assert dspark.get_scheduler("threshold", threshold=0.6).schedule(c).lengths.tolist() == [4]
    # survival 0.9, 0.63, 0.567, 0.51
    s = dspark.get_scheduler("threshold", threshold=0.55, mode="survival").schedule(c)
    assert s.lengths.tolist() == [3]
    assert dspark.get_scheduler("fixed", k=0).schedule(c).lengths.tolist() == [0]
    assert dspark.get_scheduler("full").schedule(c, torch.tensor([2])).lengths.tolist() == [2]


def test_bad_scheduler_input_messages():
    sched = dspark.get_scheduler("sps-greedy")
    with pytest.raises(ValueError, match="needs a cost model"):
        sched.schedule(torch.rand(2, 3))
    with pytest.raises(ValueError, match="calibrated probabilities"):
        sched.schedule(torch.randn(2, 3) * 5, cost_model=COSTS["flat"])
    with pytest.raises(ValueError, match="valid_lengths"):
        sched.schedule(torch.rand(2, 3), torch.tensor([1, 4]), COSTS["flat"])
    with pytest.raises(ValueError, match="scheduler 'fixed'"):
        dspark.get_scheduler("fixed", k=-1)
    with pytest.raises(ValueError, match="did you mean 'sps-greedy'"):
        dspark.get_scheduler("sps-gredy")


# --------------------------------------------------------------------------------------------
# sps-greedy against a brute force over every lengths vector (R ≤ 3, γ ≤ 4)
# --------------------------------------------------------------------------------------------


class ToyCostModel:
    """A minimal cost model (dspark.protocols.CostModel): step seconds t(B) from a function.

    ``accounting="pairs"`` is a plugin-style accounting the scheduler knows nothing about (each
    request's 1 + ℓ_r tokens rounded up to an even number): it sends sps-greedy through
    ``admission_batch_sizes``.
    """

    name = "toy"

    def __init__(self, step, accounting: str = "packed") -> None:
        self.step, self.accounting = step, accounting

    def step_seconds(self, batch_size: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.step(float(b)) for b in batch_size.tolist()], dtype=torch.float64)

    def sps(self, batch_size: torch.Tensor) -> torch.Tensor:
        return 1.0 / self.step_seconds(batch_size)

    def batch_size(self, lengths: torch.Tensor) -> int:
        if self.accounting == "packed":
            return int((1 + lengths).sum())
        return sum(2 * math.ceil((1 + int(ell)) / 2) for ell in lengths)

    def admission_batch_sizes(self, num_requests: int, positions: torch.Tensor) -> torch.Tensor:
        if self.accounting == "packed":
            return num_requests + torch.arange(positions.numel() + 1)
        # admitting position j takes a request from 1 + (j−1) to 1 + j tokens: +2 when j is even
        steps = torch.where(positions % 2 == 0, 2, 0)
        return 2 * num_requests + torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(steps, 0)])


def _brute_cost(kind: str, rng: np.random.Generator):
    """A cost model of the given kind with a random slope (t₀ = 20 ms)."""
    slope = float(rng.choice([0.001, 0.003, 0.006, 0.012]))
    if kind == "affine-packed":
        return affine(0.02, slope)
    if kind == "affine-packed-overhead":
        return SPSTableCostModel.from_points({1: 0.02 + slope, 4096: 0.02 + slope * 4096}, accounting="packed",
                                             batch_overhead=[{"num_requests": 1, "seconds": 0.01},
                                                             {"num_requests": 3, "seconds": 0.03}])
    if kind == "affine-padded":
        return affine(0.02, slope, "padded")
    if kind == "convex-packed":
        return ToyCostModel(lambda B: 0.02 + slope * B * B / 4)
    if kind == "staircase-packed":
        return SPSTableCostModel.from_points({1: 0.02, 4: 0.02 + 4 * slope, 8: 0.02 + 12 * slope, 16: 0.02 + 30 * slope},
                                             interpolation="step")
    if kind == "pairs":
        return ToyCostModel(lambda B: 0.02 + slope * B, accounting="pairs")
    return {"cpu-packed": COSTS["cpu"], "cpu-padded": COSTS["cpu-padded"]}[kind]


def _brute_case(rng: np.random.Generator):
    """Confidences [R, γ] (R ≤ 3, γ ≤ 4) with ties, zeros and ones mixed in, and valid lengths."""
    R, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    style = rng.integers(4)
    if style == 0:
        c = rng.random((R, gamma))
    elif style == 1:
        c = rng.random((R, gamma)) ** 0.2  # confident drafts
    elif style == 2:
        c = rng.choice([0.0, 0.3, 0.5, 0.9, 1.0], size=(R, gamma))  # ties across requests
    else:
        c = np.clip(rng.normal(0.7, 0.3, (R, gamma)), 0.0, 1.0)
    valid = rng.integers(0, gamma + 1, R)
    return torch.tensor(c, dtype=torch.float32), torch.tensor(valid)


def _brute_force(c, valid, cm) -> tuple[float, dict[tuple[int, ...], float]]:
    """Θ of every admissible lengths vector (every ℓ_r in 0..valid_r), and the best."""
    cl = c.tolist()
    thetas = {ell: oracle_theta(cl, ell, cm) for ell in itertools.product(*(range(int(v) + 1) for v in valid))}
    return max(thetas.values()), thetas


BRUTE_KINDS = ["affine-packed", "affine-packed-overhead", "affine-padded", "convex-packed", "staircase-packed",
               "cpu-packed", "cpu-padded", "pairs"]
# sps-greedy is lossless, not always optimal (docs/concepts.md §5 promises the stopping rule, not the
# optimum). Measured over 2000 random cases per kind (these generators, seeds crc32(kind) + i), its
# Θ equalled the brute-force optimum in: affine-packed, affine-packed-overhead, convex-packed 100 %;
# cpu-packed 97.1 % (worst Θ ratio 0.57); cpu-padded 93.9 % (0.60); staircase-packed 93.0 % (0.61);
# pairs 88.4 % (0.68); affine-padded 83.0 % (0.63). About 15 % of the cases are trivial (every
# valid_r = 0); among the others the imperfect rates are 1–3 points lower.
# The guarantee (asserted): packed accounting and t(B) + α(R) convex in B (affine included). Along
# the admission order Θ_k = τ_k / (t(R + k) + α), τ_k concave (a sorted descending): a concave
# over a convex positive function is quasi-concave, so Θ_k has no plateau before its maximum and the
# early break stops there; and under packed accounting every lengths vector with k admissions has
# B = R + k and τ at most that of the k largest a, so that maximum is the global one (which
# sps-argmax also finds, for any t). Packed also makes greedy a local optimum (no ℓ_r ± 1 is better:
# asserted). Padded and "pairs" accountings break it: the next candidate by a may raise max ℓ (B
# jumps by R) and stop the scan while a lower-a candidate at an already-paid position was free —
# greedy was not even a local optimum in 4 % (affine-padded), 3 % (cpu-padded) and 8 % (pairs) of
# the cases. Non-convex t (the shipped CPU profile's jump from B = 1 to 2, a staircase) costs less.
GREEDY_IS_OPTIMAL = {"affine-packed", "affine-packed-overhead", "convex-packed"}
PACKED = {"affine-packed", "affine-packed-overhead", "convex-packed", "staircase-packed", "cpu-packed"}
N_BRUTE = 60


@pytest.mark.parametrize("kind", BRUTE_KINDS)
def test_sps_greedy_against_brute_force(kind):
    """Over every admissible lengths vector: greedy Θ is Θ of its own lengths, never below plain
    decoding, never above the optimum; under packed accounting it is a local optimum (no single
    ℓ_r ± 1 raises Θ) and sps-argmax finds the global optimum; with t(B) convex greedy does too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyScheduleWarning)
        argmax = dspark.get_scheduler("sps-argmax")
    greedy = dspark.get_scheduler("sps-greedy")
    for i in range(N_BRUTE):
        rng = np.random.default_rng(zlib.crc32(kind.encode()) + i)  # stable across processes
        cm = _brute_cost(kind, rng)
        c, valid = _brute_case(rng)
        R = c.shape[0]
        sch = greedy.schedule(c, valid, cm)
        best, thetas = _brute_force(c, valid, cm)
        ell = tuple(sch.lengths.tolist())
        label = f"{kind} case {i}: c={c.tolist()} valid={valid.tolist()} greedy ℓ={ell}"
        assert ell in thetas, label  # 0 ≤ ℓ_r ≤ valid_r
        assert math.isclose(sch.expected_throughput, thetas[ell], rel_tol=1e-6), label
        assert thetas[ell] >= thetas[(0,) * R] * (1 - 1e-9), label
        assert thetas[ell] <= best * (1 + 1e-9), label
        if kind in PACKED:
            for r in range(R):
                for step in (-1, 1):
                    moved = ell[:r] + (ell[r] + step,) + ell[r + 1 :]
                    if moved in thetas:
                        assert thetas[moved] <= thetas[ell] * (1 + 1e-9), f"{label}: ℓ{moved} is better"
            assert math.isclose(argmax.schedule(c, valid, cm).expected_throughput, best, rel_tol=1e-6), label
        if kind in GREEDY_IS_OPTIMAL:
            assert math.isclose(thetas[ell], best, rel_tol=1e-9), f"{label}: optimum {best}, greedy {thetas[ell]}"


def _round_rate(c, lengths, cm, sunk: float) -> float:
    """τ / (s + t(B) + α(R)): the round's tokens per second when s seconds were already spent."""
    step = float(cm.step_seconds(torch.tensor([oracle_batch(lengths, cm.accounting)]))[0])
    return oracle_tau(c, lengths) / (sunk + step + getattr(cm, "batch_overhead_seconds", lambda _r: 0.0)(len(lengths)))


SUNK_KINDS = ["affine-packed", "affine-packed-overhead", "convex-packed", "cpu-packed"]


@pytest.mark.parametrize("kind", SUNK_KINDS)
def test_sunk_sps_greedy_maximises_the_rounds_own_rate(kind):
    """sps-greedy:sunk=true against brute force over every lengths vector, with the round's rate
    τ / (s + t(B) + α(R)) written out here (s: seconds already spent): its ℓ is that rate's
    optimum where t is convex (the same guarantee as the paper's Θ), never below plain decoding,
    and it verifies at least as many drafts as the paper's Θ, which leaves s out."""
    plain_theta = dspark.get_scheduler("sps-greedy")
    sunk = dspark.get_scheduler("sps-greedy", sunk=True)
    for i in range(N_BRUTE):
        rng = np.random.default_rng(zlib.crc32(f"sunk-{kind}".encode()) + i)
        cm = _brute_cost(kind, rng)
        s = float(rng.choice([0.0, 0.005, 0.02, 0.08]))
        c, valid = _brute_case(rng)
        R, cl = c.shape[0], c.tolist()
        rates = {ell: _round_rate(cl, ell, cm, s) for ell in itertools.product(*(range(int(v) + 1) for v in valid))}
        ell = tuple(sunk.schedule(c, valid, with_sunk_seconds(sunk, cm, s)).lengths.tolist())
        label = f"{kind} case {i}: s={s} c={cl} valid={valid.tolist()} ℓ={ell}"
        assert rates[ell] >= rates[(0,) * R] * (1 - 1e-9), label
        if kind in GREEDY_IS_OPTIMAL:
            assert math.isclose(rates[ell], max(rates.values()), rel_tol=1e-9), label
        assert sum(ell) >= int(plain_theta.schedule(c, valid, cm).lengths.sum()), label


def test_sunk_seconds_lengthen_a_cpu_round_at_one_request():
    """The case that motivated the variant (bench30, c = 1): verifying 1 or 8 tokens costs 22.5 or
    25.4 ms and the draft already took 25 ms. With a typical survival, the paper's Θ stops after
    position 5 (a_6 = 0.036 < Θ · Δt = 109 · 0.41 ms); counting the 25 ms halves Θ, a_6 and a_7
    pay and all 7 are verified."""
    cm = SPSTableCostModel.from_points({1: 0.0225, 8: 0.0254}, accounting="padded")
    c = torch.tensor([[0.8, 0.6, 0.5, 0.45, 0.55, 0.6, 0.65]])  # a = 0.8 0.48 0.24 0.108 0.059 0.036 0.023
    valid = torch.tensor([7])
    paper = dspark.get_scheduler("sps-greedy")
    sunk = dspark.get_scheduler("sps-greedy", sunk=True)
    assert paper.schedule(c, valid, cm).lengths.tolist() == [5]
    assert sunk.schedule(c, valid, with_sunk_seconds(sunk, cm, 0.025)).lengths.tolist() == [7]
    # the wrapper is the cost model for everything but α(R), and only for a scheduler that counts s
    wrapped = with_sunk_seconds(sunk, cm, 0.025)
    assert isinstance(wrapped, SunkCost) and wrapped.accounting == "padded"
    assert wrapped.batch_overhead_seconds(1) == pytest.approx(0.025)
    assert with_sunk_seconds(paper, cm, 0.025) is cm and with_sunk_seconds(sunk, None, 0.025) is None
    with pytest.raises(ValueError, match="sunk"):
        dspark.get_scheduler("sps-greedy", sunk="yes")
