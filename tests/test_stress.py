"""Under load (issue 14): 256 submissions through one Engine on a tiny random Llama target with a
random DSpark drafter, sps-greedy: at most 64 unfinished at a time, mixed prompt lengths and
budgets, requests joining while others decode, ~10 % aborted mid-decode (two of them in the round
that finishes them), and one bad request that must be refused without disturbing the others.

Asserted: none lost, none collected twice; every finished output is the target's own greedy
decode (HF ``generate``), every aborted one a strict prefix of it, reported as ``abort`` and
silent after the abort; the bad request is a ``ValueError`` naming the problem; after every round
the target's and the drafter's per-request caches belong to exactly the unfinished requests (an
aborted request's at once) and nothing is held at the end.

The scenario (job mix, driver, batched reference decode) is ``scripts/stress.py``'s, which runs it
on the real SmolLM2 target and reports resident memory (docs/serving-and-benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dspark.engine import Engine
from dspark.gating import DraftGate
from dspark.targets import HFTarget
from helpers import TickClock, greedy_decode, tiny_causal_lm

ROOT = Path(__file__).resolve().parents[1]
V, CONTEXT, REQUESTS, CONCURRENCY, MAX_NEW = 16, 96, 256, 64, 24

pytestmark = pytest.mark.usefixtures("one_thread")


def _load_script():
    spec = importlib.util.spec_from_file_location("dspark_stress_script", ROOT / "scripts" / "stress.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


stress = _load_script()


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm(vocab_size=V, max_positions=CONTEXT)  # no EOS: decodes run to their budget


# "gate": the draft gate as dspark demo / bench run sps-greedy, with short skips (test_engine.py's
# gate_for) and a virtual clock, so drafted and gate-skipped rounds mix deterministically.
# "always": no gate, every round drafted. Each case has its own kind of bad request.
CASES = {"gate+long-prompt": (True, "long", "context window is 96"),
         "always+empty-prompt": (False, "empty", "prompt is empty")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_256_requests_under_load(model, case):
    gated, bad, message = CASES[case]
    target = HFTarget(model)
    engine = Engine(target, stress.tiny_drafter(target), scheduler="sps-greedy", cost_model=stress.flat_cost_model(),
                    draft_gate=DraftGate(min_backoff=1, max_backoff=2, hopeless_skip=2) if gated else None,
                    clock=TickClock())
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, V, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g) for _ in range(64)]
    jobs = stress.make_jobs(pool, REQUESTS, MAX_NEW, max_context=CONTEXT, seed=0, bad=bad)
    good = [j for j in jobs if j.bad is None]
    (bad_job,) = [j for j in jobs if j.bad is not None]
    mid = {j.request_id for j in good if j.abort_after is not None and j.max_new_tokens == MAX_NEW}
    late = {j.request_id for j in good if j.abort_after is not None and j.max_new_tokens == 1}
    assert len(good) == REQUESTS - 1 and len(mid) == 24 and len(late) == 2
    assert len({j.prompt.numel() for j in good}) > 20 and len({j.max_new_tokens for j in good}) == MAX_NEW

    run = stress.drive(engine, jobs, CONCURRENCY)

    # the bad request: refused with a clear error, nothing of it admitted, nothing else changed
    assert run.rejected == {bad_job.index: ("ValueError", run.rejected[bad_job.index][1])}
    assert message in run.rejected[bad_job.index][1] and repr(bad_job.request_id) in run.rejected[bad_job.index][1]
    assert run.accepted_bad == [] and run.bad_disturbed == [] and bad_job.request_id not in run.admitted
    # load: the cap was reached and never exceeded; requests joined while others were decoding
    assert run.max_active == CONCURRENCY
    assert run.joins_mid_decode > REQUESTS // 2
    # drafts were really verified and accepted (else the identity below would test plain decoding)
    assert run.verified_drafts > 0 and run.accepted_drafts > 0
    if gated:
        assert run.drafted_rounds > 0 and run.skipped_rounds > 0
    else:
        assert run.skipped_rounds == 0 and run.drafted_rounds == run.steps
    # none lost, none twice
    assert sorted(run.admitted) == sorted(j.request_id for j in good)
    assert sorted(run.completions) == sorted(run.admitted)
    assert run.duplicates == [] and run.unknown == []

    refs = stress.reference_decode(model, [j.prompt for j in good], [j.max_new_tokens for j in good], None)
    for job, ref in zip(good, refs):
        c = run.completions[job.request_id]
        assert c.output_ids == run.streamed[job.request_id], f"{job.request_id}: completion ≠ streamed tokens"
        if c.output_ids != ref[: len(c.output_ids)]:  # the batched reference is decided by an unbatched one
            ref = greedy_decode(model, job.prompt, job.max_new_tokens)
        if job.request_id in mid:
            assert c.finish_reason == "abort", f"{job.request_id} was aborted mid-decode"
            assert 1 <= len(c.output_ids) == run.aborted_running[job.request_id] < job.max_new_tokens
            assert c.output_ids == ref[: len(c.output_ids)], f"aborted {job.request_id} left the greedy decode"
        else:
            assert c.finish_reason == "length", job.request_id
            assert c.output_ids == ref, f"{job.request_id} diverged from the target's greedy decode"
    # aborts: every mid-decode abort took effect at once, nothing streamed after it; aborting a
    # request in the round that finished it changed nothing
    assert set(run.aborted_running) == mid
    assert run.not_released_on_abort == [] and run.after_end == {}
    assert run.abort_noop == dict.fromkeys(late, "length")
    assert all(len(run.completions[r].output_ids) == 1 for r in late)

    # memory bounded: held state = the unfinished requests after every round, nothing at the end
    assert run.leaks == []
    assert run.held_after == {"engine": [], "target": [], "drafter": []}
    assert engine.active == [] and target.request_ids == ()
    held = stress.held_bytes(engine)
    assert held["target_kv"] == 0 and held["drafter_kv"] == 0 and held["target_scratch"] == 0
