"""The start-up warm-up of a compiled step (dspark.fast.warm): after it, serving compiles nothing.

The oracle is torch's own count of the graphs it compiled: after :func:`warm_up` at one and two
requests, requests joining and leaving (one to three at a time), drafted and plain rounds, a
drafter on the compiled runner, and a lone request afterwards meet no new shape class; and the
outputs stay the target's greedy decode.
"""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.engine import Engine
from dspark.fast import FastTarget
from dspark.fast.drafter import use_draft_runner
from dspark.fast.warm import WarmUp, warm_up
from dspark.types import SamplingParams
from helpers import TickClock, greedy_decode, run_with_late_join, tiny_causal_lm
from test_fast_step import FLAT, PROMPTS, V, _drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_after_the_warm_up_serving_compiles_no_graph():
    model = tiny_causal_lm("llama", vocab_size=V, max_positions=256, num_layers=3, init_range=0.3)
    target = FastTarget(model, path="compiled")
    drafter = _drafter(target, "dspark:vanilla-markov")
    assert use_draft_runner(drafter, "compiled") == "compiled"
    warm = warm_up(target, drafter, torch.tensor([4, 8, 15, 3, 11, 6]), cost_model=FLAT)
    assert warm.batch_sizes == (1, 2) and warm.graphs > 0 and warm.seconds > 0
    assert warm.reason.startswith(f"warm-up: {warm.graphs} graphs compiled in")
    before = _graphs()
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler("sps-greedy"), cost_model=FLAT, clock=TickClock())
    prompts = [torch.tensor(p) for p in PROMPTS]
    rids, done = run_with_late_join(engine, prompts, 24)  # 1, 2, 3 requests at a time, then fewer
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p, 24)
    plain = Engine(target, None, cost_model=FLAT)
    outs = plain.generate(prompts, SamplingParams.greedy(), max_new_tokens=10, progress=False)
    assert [o.output_ids for o in outs] == [greedy_decode(model, p, 10) for p in prompts]
    (alone,) = engine.generate([prompts[2]], SamplingParams.greedy(), max_new_tokens=12, progress=False)
    assert alone.output_ids == greedy_decode(model, prompts[2], 12)
    assert _graphs() == before, f"{_graphs() - before} graphs compiled after the warm-up"
    assert target.path == "compiled" and drafter.loop.runner.path == "compiled"


def test_after_the_warm_up_a_bf16_drafter_compiles_no_graph(monkeypatch):
    """In bf16 the compiled graphs split by rows (the GEMM template's few rows and oneDNN's
    more, dspark.fast.compile.row_class), the drafter's context calls too: after the warm-up,
    prompts of other lengths and requests joining and leaving meet no new class. The bound is set
    to 4 (the one without AMX) so the drafter's rounds (γ = 4) reach every class on any CPU; in
    bf16 no identity is asserted (the fp32 test above holds it)."""
    from dspark.fast.linear import bf16_packing_supported

    if not bf16_packing_supported():
        pytest.skip("this CPU's oneDNN has no bf16 products (no AVX-512 or AVX-NE-CONVERT): no bf16 compiled step")
    monkeypatch.setattr("dspark.fast.compile.few_rows", lambda: 4)
    model = tiny_causal_lm("llama", vocab_size=V, max_positions=256, num_layers=3, init_range=0.3)
    target = FastTarget(model.to(torch.bfloat16), path="compiled")
    drafter = _drafter(target, "dspark:vanilla-markov").to(torch.bfloat16)
    assert use_draft_runner(drafter, "compiled") == "compiled"
    warm_up(target, drafter, torch.tensor([4, 8, 15, 3, 11, 6]), cost_model=FLAT)
    before = _graphs()
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler("sps-greedy"), cost_model=FLAT, clock=TickClock())
    prompts = [torch.tensor(p) for p in PROMPTS]
    run_with_late_join(engine, prompts, 24)
    Engine(target, None, cost_model=FLAT).generate(prompts, SamplingParams.greedy(), max_new_tokens=10, progress=False)
    for p in prompts:
        engine.generate([p], SamplingParams.greedy(), max_new_tokens=12, progress=False)
    assert _graphs() == before, f"{_graphs() - before} graphs compiled after the warm-up"
    assert target.path == "compiled" and drafter.loop.runner.path == "compiled"


def test_warm_up_checks_its_batch_sizes():
    model = tiny_causal_lm("llama", vocab_size=V, max_positions=64)
    target = FastTarget(model, path="packed")
    with pytest.raises(ValueError, match="positive request counts"):
        warm_up(target, None, torch.tensor([1, 2]), batch_sizes=(0,))
    done = warm_up(target, None, torch.tensor([1, 2]), batch_sizes=(3,))  # plain decoding, any step
    assert isinstance(done, WarmUp) and done.batch_sizes == (3,)
