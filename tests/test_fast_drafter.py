"""The draft round on a compiled runner (dspark.fast.drafter) against the eager drafter.

* a compiled drafter's blocks equal the eager drafter's on the same contexts (the eager drafter is
  the oracle), and the engine with it is greedy-identical to the target's own decode;
* sampling through the compiled drafter keeps the target's law (χ², fixed seeds);
* the fallbacks: a graph that fails to compile, and a machine where torch.compile cannot run,
  leave the drafter eager with one logged sentence;
* the start-up race leaves the drafter on the runner it reports.
"""

from __future__ import annotations

import logging

import pytest
import torch

import dspark
from dspark.drafters.loop import TorchRunner
from dspark.engine import Engine
from dspark.fast import FastTarget
from dspark.fast.compile import CompileUnavailable
from dspark.fast.drafter import choose_draft_runner, use_draft_runner
from dspark.types import SamplingParams
from helpers import (
    TickClock,
    assert_same_distribution,
    exact_two_token_probs,
    greedy_decode,
    run_with_late_join,
    sequence_counts,
    tiny_causal_lm,
)
from test_fast_step import FLAT, PROMPTS, V, _drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def _model():
    return tiny_causal_lm("llama", vocab_size=V, max_positions=96, num_layers=3, init_range=0.3)


def _contexts(target, drafter):
    """The DraftContexts an engine hands the drafter over a run with a late join (recorded)."""
    seen = []
    inner = drafter.draft

    def spy(context):
        seen.append(context)
        return inner(context)

    drafter.draft = spy
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler("full"), cost_model=FLAT, clock=TickClock())
    run_with_late_join(engine, [torch.tensor(p) for p in PROMPTS], 12)
    del drafter.draft
    return seen


# each compiled drafter costs tens of seconds of compiling: one block drafter with a head (its
# backbone and context graphs are DFlash's too) and the autoregressive one
@pytest.mark.parametrize("dname", ["dspark:gated-markov", "eagle3"])
def test_a_compiled_drafter_drafts_what_the_eager_drafter_drafts(dname):
    """Replay every round's context through a fresh eager and a fresh compiled drafter (same weights)."""
    model = _model()
    target = FastTarget(model, path="packed")
    contexts = _contexts(target, _drafter(target, dname))
    eager, compiled = _drafter(target, dname), _drafter(target, dname)
    assert use_draft_runner(compiled, "compiled") == "compiled"
    for context in contexts:
        a, b = eager.draft(context), compiled.draft(context)
        assert torch.equal(a.tokens, b.tokens), f"{dname}: greedy drafts differ"
        torch.testing.assert_close(b.draft_logits, a.draft_logits, atol=1e-4, rtol=1e-4)
        if a.confidence_logits is not None:
            torch.testing.assert_close(b.confidence_logits, a.confidence_logits, atol=1e-4, rtol=1e-4)
    assert isinstance(compiled.loop.runner, TorchRunner) and compiled.loop.runner.path == "compiled"


@pytest.mark.parametrize("dname,sched", [("eagle3", "sps-greedy")])
def test_the_engine_with_a_compiled_drafter_is_greedy_identical(dname, sched):
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _drafter(target, dname)
    use_draft_runner(drafter, "compiled")
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler(sched), cost_model=FLAT, clock=TickClock())
    prompts = [torch.tensor(p) for p in PROMPTS]
    rids, done = run_with_late_join(engine, prompts, 20)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p, 20), f"{dname}/{sched}: {rid} diverged"
    assert sum(c.metrics["accepted"] for c in done.values()) > 0
    assert drafter.loop.runner.path == "compiled"  # no silent fallback


def test_sampling_through_a_compiled_drafter_matches_the_target():
    """Joint law of the first two sampled tokens = plain target sampling (χ², fixed seeds)."""
    params = SamplingParams(temperature=1.0)
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _drafter(target, "dspark:gated-markov")
    use_draft_runner(drafter, "compiled")
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler("sps-greedy"), cost_model=FLAT, seed=11,
                    clock=TickClock())
    prompt = torch.tensor([7, 13, 11, 7, 13, 11, 7, 13])
    out = engine.generate([prompt] * 1500, params, max_new_tokens=3, progress=False)
    tokens = torch.tensor([c.output_ids[:2] for c in out])
    assert_same_distribution(sequence_counts(tokens, V), exact_two_token_probs(model, prompt, params),
                             "compiled drafter / T1", exact_support=False)
    assert sum(c.metrics["accepted"] for c in out) > 0
    assert drafter.loop.runner.path == "compiled"


def test_a_graph_that_fails_to_compile_runs_eager_in_one_sentence(caplog):
    model = _model()
    target = FastTarget(model, path="packed")
    contexts = _contexts(target, _drafter(target, "dspark:gated-markov"))
    eager, compiled = _drafter(target, "dspark:gated-markov"), _drafter(target, "dspark:gated-markov")
    use_draft_runner(compiled, "compiled")
    runner = compiled.loop.runner

    def failing(**inputs):
        raise RuntimeError("LoweringException: an op inductor cannot lower")

    runner._graphs = {name: (failing, outputs) for name, (_m, outputs) in
                      {g.name: (g.module, g.outputs) for g in compiled.graph_specs(compiled, live=True)}.items()}
    with caplog.at_level(logging.WARNING, logger="dspark.drafters.loop"):
        got = compiled.draft(contexts[0])
    (record,) = [r for r in caplog.records if r.name == "dspark.drafters.loop"]
    assert "LoweringException" in record.getMessage() and "runs eager" in record.getMessage()
    assert runner.path == "eager"
    want = eager.draft(contexts[0])
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.draft_logits, want.draft_logits, atol=1e-5, rtol=1e-5)


def test_no_compiler_leaves_the_drafter_eager(monkeypatch, caplog):
    def broken(device):
        raise CompileUnavailable("torch.compile cannot run on cpu here (InvalidCxxCompiler: no C++ compiler)")

    monkeypatch.setattr("dspark.fast.compile.check_compiler", broken)
    target = FastTarget(_model(), path="packed")
    drafter = _drafter(target, "dflash")
    with caplog.at_level(logging.WARNING, logger="dspark.fast.drafter"):
        assert use_draft_runner(drafter, "compiled") == "eager"
    assert "no C++ compiler" in caplog.text and "runs eager" in caplog.text
    assert drafter.loop.runner.path == "eager"
    with pytest.raises(ValueError, match="draft runner must be one of eager, compiled, got 'onnx'"):
        use_draft_runner(drafter, "onnx")
    ngram = dspark.get_drafter("ngram", vocab_size=V, gamma=4)
    assert use_draft_runner(ngram, "compiled") == "own"  # not a graph drafter: nothing to switch


def test_the_race_leaves_the_drafter_on_the_runner_it_reports():
    target = FastTarget(_model(), path="packed")
    drafter = _drafter(target, "dflash")
    ids = [torch.tensor(p) for p in PROMPTS[::2]]
    choice = choose_draft_runner(target, drafter, ids, FLAT, rounds=3)
    assert set(choice.overhead_seconds) == {"eager", "compiled"}
    assert choice.runner == min(choice.overhead_seconds, key=choice.overhead_seconds.__getitem__)
    assert drafter.loop.runner.path == choice.runner
    assert choice.compile_seconds is not None and choice.compile_seconds > 0
    assert choice.reason.startswith(f"draft round on the {choice.runner} runner: eager ")
    assert choice.to_dict()["runner"] == choice.runner
    assert list(target.request_ids) == []  # the race's engines left nothing behind


def test_the_race_does_not_time_a_runner_that_fell_back_as_compiled(monkeypatch, caplog):
    """A graph that fails to compile in the race's warm-up leaves the runner eager: the race must
    say so instead of reporting eager timings under 'compiled'."""
    def failing(module, device, **kw):
        def run(**inputs):
            raise RuntimeError("LoweringException: an op inductor cannot lower")
        return run

    monkeypatch.setattr("dspark.fast.compile.compile_step", failing)
    target = FastTarget(_model(), path="packed")
    drafter = _drafter(target, "dflash")
    with caplog.at_level(logging.WARNING, logger="dspark.drafters.loop"):
        choice = choose_draft_runner(target, drafter, [torch.tensor(p) for p in PROMPTS[::2]], FLAT, rounds=3)
    assert set(choice.overhead_seconds) == {"eager"} and choice.runner == "eager"
    assert choice.notes == ("compiled: a graph failed to compile, the drafter ran eager",)
    assert "LoweringException" in caplog.text
    assert drafter.loop.runner.path == "eager"
