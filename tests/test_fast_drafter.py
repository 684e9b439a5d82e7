"""The draft round on a compiled or an ONNX Runtime runner (dspark.fast.drafter) against the eager drafter.

* a compiled drafter's blocks equal the eager drafter's on the same contexts (the eager drafter is
  the oracle), and the engine with it is greedy-identical to the target's own decode;
* likewise on the onnxruntime runner (the live drafter's graphs exported to a temporary folder):
  tokens equal, logits and confidence logits within 1e-4 (fp32), greedy identity of the engine;
* sampling through the compiled drafter keeps the target's law (χ², fixed seeds; through the
  onnxruntime runner: test_fast_drafter_ort);
* the fallbacks: a graph that fails to compile or to run in onnxruntime, and a machine where
  torch.compile cannot run, leave the drafter eager with one logged sentence; a drafter onnxruntime
  cannot run (bf16, a graph that does not export, an n-gram drafter) is skipped in one sentence;
* the start-up race leaves the drafter on the runner it reports — the very runner it timed;
* the sequential head's opt-in survival floor ends each draft where its survival falls below it,
  leaves what precedes unchanged, and keeps greedy identity and the sampled law;
* a draft layer's products fuse into one only inside a compiled inference graph, with the separate
  products' values; its grouped-query attention is bit-equal to attention over repeated K/V heads.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

import dspark
from dspark.drafters.loop import GraphCalls, TorchRunner
from dspark.engine import Engine
from dspark.export.live import LiveOrtRunner
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

needs_onnx = pytest.mark.skipif(
    importlib.util.find_spec("onnx") is None or importlib.util.find_spec("onnxruntime") is None,
    reason="the onnxruntime runner needs onnx and onnxruntime: pip install 'dspark[onnx]'")


def _model():
    return tiny_causal_lm("llama", vocab_size=V, max_positions=96, num_layers=3, init_range=0.3)


def _contexts(target, drafter, one_at_a_time: bool = False):
    """The DraftContexts an engine hands the drafter over a run with a late join, or over the
    prompts one request at a time (recorded; a one-request context holds the engine's stopping
    rule for the ``full`` scheduler, dspark.round.schedule_stop)."""
    seen = []
    inner = drafter.draft

    def spy(context):
        seen.append(context)
        return inner(context)

    drafter.draft = spy
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler("full"), cost_model=FLAT, clock=TickClock())
    if one_at_a_time:
        for p in PROMPTS:
            engine.generate([torch.tensor(p)], SamplingParams.greedy(), max_new_tokens=12, progress=False)
    else:
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
    assert_engine_is_greedy_identical(model, target, drafter, f"{dname}/{sched}", sched)
    assert drafter.loop.runner.path == "compiled"  # no silent fallback


def assert_engine_is_greedy_identical(model, target, drafter, label, sched="sps-greedy", n=20):
    """The engine with ``drafter`` over requests joining late decodes what ``model`` decodes
    greedily by itself, with some drafts accepted."""
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler(sched), cost_model=FLAT, clock=TickClock())
    prompts = [torch.tensor(p) for p in PROMPTS]
    rids, done = run_with_late_join(engine, prompts, n)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p, n), f"{label}: {rid} diverged"
    assert sum(c.metrics["accepted"] for c in done.values()) > 0


def _assert_sampling_keeps_the_target_law(model, target, drafter, sched, label):
    """Joint law of the first two tokens the engine samples with ``drafter`` (T = 1) = plain
    sampling of the target ``model`` itself (χ², fixed seeds; the oracle never runs the drafter),
    with some draft tokens accepted."""
    params = SamplingParams(temperature=1.0)
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler(sched), cost_model=FLAT, seed=11,
                    clock=TickClock())
    prompt = torch.tensor([7, 13, 11, 7, 13, 11, 7, 13])
    out = engine.generate([prompt] * 1500, params, max_new_tokens=3, progress=False)
    tokens = torch.tensor([c.output_ids[:2] for c in out])
    assert_same_distribution(sequence_counts(tokens, V), exact_two_token_probs(model, prompt, params), label,
                             exact_support=False)
    assert sum(c.metrics["accepted"] for c in out) > 0


def test_sampling_through_a_compiled_drafter_matches_the_target():
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _drafter(target, "dspark:gated-markov")
    use_draft_runner(drafter, "compiled")
    _assert_sampling_keeps_the_target_law(model, target, drafter, "sps-greedy", "compiled drafter / T1")
    assert drafter.loop.runner.path == "compiled"


def _assert_falls_back_to_eager(caplog, logger, error, drafter, eager, runner, context):
    """A graph failing on ``drafter``'s runner: one warning naming ``error``, the runner now eager,
    and the block drafted equal to the eager drafter's."""
    with caplog.at_level(logging.WARNING, logger=logger):
        got = drafter.draft(context)
    (record,) = [r for r in caplog.records if r.name == logger]
    assert error in record.getMessage() and "runs eager" in record.getMessage()
    assert runner.path == "eager"
    want = eager.draft(context)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.draft_logits, want.draft_logits, atol=1e-5, rtol=1e-5)


def test_a_graph_that_fails_to_compile_runs_eager_in_one_sentence(caplog):
    model = _model()
    target = FastTarget(model, path="packed")
    contexts = _contexts(target, _drafter(target, "dspark:gated-markov"))
    eager, compiled = _drafter(target, "dspark:gated-markov"), _drafter(target, "dspark:gated-markov")
    use_draft_runner(compiled, "compiled")
    runner = compiled.loop.runner

    def failing(**inputs):
        raise RuntimeError("LoweringException: an op inductor cannot lower")

    runner._graphs = {g.name: (failing, None, g.outputs) for g in compiled.graph_specs(compiled, live=True)}
    _assert_falls_back_to_eager(caplog, "dspark.drafters.loop", "LoweringException", compiled, eager, runner,
                                contexts[0])


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
    with pytest.raises(ValueError, match="draft runner must be one of eager, compiled, onnxruntime, got 'onnx'"):
        use_draft_runner(drafter, "onnx")
    ngram = dspark.get_drafter("ngram", vocab_size=V, gamma=4)
    assert use_draft_runner(ngram, "compiled") == "own"  # not a graph drafter: nothing to switch


@needs_onnx
def test_the_race_leaves_the_drafter_on_the_runner_it_reports():
    target = FastTarget(_model(), path="packed")
    drafter = _drafter(target, "dflash")
    ids = [torch.tensor(p) for p in PROMPTS[::2]]
    choice = choose_draft_runner(target, drafter, ids, FLAT, rounds=3)
    assert set(choice.overhead_seconds) == {"eager", "compiled", "onnxruntime"}
    assert choice.runner == min(choice.overhead_seconds, key=choice.overhead_seconds.__getitem__)
    assert drafter.loop.runner.path == choice.runner
    assert choice.compile_seconds is not None and choice.compile_seconds > 0
    assert choice.export_seconds is not None and choice.export_seconds > 0
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
        choice = choose_draft_runner(target, drafter, [torch.tensor(p) for p in PROMPTS[::2]], FLAT, rounds=3,
                                     candidates=("eager", "compiled"))
    assert set(choice.overhead_seconds) == {"eager"} and choice.runner == "eager"
    assert choice.notes == ("compiled: a graph failed to compile, the drafter ran eager",)
    assert "LoweringException" in caplog.text
    assert drafter.loop.runner.path == "eager"


# -- the onnxruntime runner (dspark.export.live) --------------------------------------------


def _ort_drafter(target, dname):
    """test_fast_step's tiny drafters; the DSpark one with a confidence head (its logits compared too)."""
    if dname != "dspark:gated-markov+confidence":
        return _drafter(target, dname)
    torch.manual_seed(1)
    d = dspark.get_drafter("dspark", target=target, gamma=4, num_layers=2, head="gated-markov", rank=8,
                           confidence=True)
    for p in d.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.2)
    return d


@needs_onnx
@pytest.mark.parametrize("dname", ["dspark:gated-markov+confidence", "eagle3"])
def test_an_onnxruntime_drafter_drafts_what_the_eager_drafter_drafts(dname):
    """Replay every round's engine context through a fresh eager drafter and a fresh one on the
    onnxruntime runner (same weights): tokens equal; logits, confidence logits and hidden states
    within 1e-4 (fp32 in both: only the order of the float operations differs)."""
    model = _model()
    target = FastTarget(model, path="packed")
    contexts = _contexts(target, _ort_drafter(target, dname))
    eager, ort = _ort_drafter(target, dname), _ort_drafter(target, dname)
    assert use_draft_runner(ort, "onnxruntime") == "onnxruntime"
    assert isinstance(ort.loop.runner, LiveOrtRunner)
    for context in contexts:
        a, b = eager.draft(context), ort.draft(context)
        assert torch.equal(a.tokens, b.tokens), f"{dname}: greedy drafts differ"
        torch.testing.assert_close(b.draft_logits, a.draft_logits, atol=1e-4, rtol=1e-4)
        assert (a.confidence_logits is None) == (dname == "eagle3")
        if a.confidence_logits is not None:
            torch.testing.assert_close(b.confidence_logits, a.confidence_logits, atol=1e-4, rtol=1e-4)
        if a.hidden is not None:
            torch.testing.assert_close(b.hidden, a.hidden, atol=1e-4, rtol=1e-4)
    assert ort.loop.runner.path == "onnxruntime"  # no silent fallback


@needs_onnx
@pytest.mark.parametrize("dname", ["dspark:gated-markov+confidence", "eagle3"])
def test_the_engine_with_an_onnxruntime_drafter_is_greedy_identical(dname):
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _ort_drafter(target, dname)
    assert use_draft_runner(drafter, "onnxruntime") == "onnxruntime"
    assert_engine_is_greedy_identical(model, target, drafter, dname)
    assert drafter.loop.runner.path == "onnxruntime"


def test_onnxruntime_skips_what_it_cannot_run_in_one_sentence(caplog):
    """A bf16 drafter and an n-gram drafter (no graphs): no crash, the drafter keeps a runner of its own."""
    target = FastTarget(_model(), path="packed")
    half = _drafter(target, "dflash").to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="dspark.fast.drafter"):
        assert use_draft_runner(half, "onnxruntime") == "eager"
    (record,) = [r for r in caplog.records if r.name == "dspark.fast.drafter"]
    assert record.getMessage() == (
        "onnxruntime cannot run this drafter here (the drafter computes in bfloat16; onnxruntime's CPU provider "
        "has no bfloat16 MatMul, and fp32 graphs would draft other blocks than it does); the drafter runs eager")
    assert half.loop.runner.path == "eager"
    ngram = dspark.get_drafter("ngram", vocab_size=V, gamma=4)
    assert use_draft_runner(ngram, "onnxruntime") == "own"
    choice = choose_draft_runner(target, ngram, [torch.tensor(PROMPTS[0])], FLAT, rounds=3)
    assert choice.runner == "own" and choice.overhead_seconds == {}
    assert choice.reason == "draft round on the own runner: nothing timed (NGramDrafter drafts its own way)"


def test_the_race_skips_a_drafter_whose_graphs_do_not_export(monkeypatch, caplog):
    def failing(drafter, folder, **kw):
        raise RuntimeError("UnsupportedOperatorError: an op the ONNX exporter cannot write")

    monkeypatch.setattr("dspark.export.export_onnx", failing)
    monkeypatch.setattr("dspark.export.live.check_exportable", lambda drafter: None)  # onnx may be absent
    target = FastTarget(_model(), path="packed")
    drafter = _drafter(target, "dflash")
    with caplog.at_level(logging.INFO, logger="dspark.fast.drafter"):
        choice = choose_draft_runner(target, drafter, [torch.tensor(p) for p in PROMPTS[::2]], FLAT, rounds=3,
                                     candidates=("eager", "onnxruntime"))
    why = ("onnxruntime cannot run this drafter here (its graphs did not export to ONNX (RuntimeError: "
           "UnsupportedOperatorError: an op the ONNX exporter cannot write))")
    assert choice.notes == (f"onnxruntime skipped: {why}",)
    assert f"the onnxruntime draft runner is skipped: {why}" in caplog.text
    assert set(choice.overhead_seconds) == {"eager"} and choice.runner == "eager"
    assert choice.export_seconds is None
    assert drafter.loop.runner.path == "eager"


@needs_onnx
def test_a_graph_that_fails_in_onnxruntime_runs_eager_in_one_sentence(caplog):
    model = _model()
    target = FastTarget(model, path="packed")
    contexts = _contexts(target, _drafter(target, "dflash"))
    eager, ort = _drafter(target, "dflash"), _drafter(target, "dflash")
    use_draft_runner(ort, "onnxruntime")
    runner = ort.loop.runner

    def failing(graph, inputs):
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : a shape the kernel rejects")

    runner.sessions.run = failing
    _assert_falls_back_to_eager(caplog, "dspark.export.live", "INVALID_ARGUMENT", ort, eager, runner, contexts[0])


@needs_onnx
@pytest.mark.parametrize("winner", ["eager", "onnxruntime"])
def test_the_race_keeps_the_runner_it_timed(monkeypatch, winner):
    """Timings faked per runner: each candidate is warmed up (one pass) before it is timed, and the
    winner is the very runner object that was timed — nothing exports or compiles again."""
    calls = []

    def fake(target, drafter, ids, num_requests, cost_model, calibrator=None, rounds=4, passes=3, **kw):
        runner = drafter.loop.runner
        calls.append((runner.path, passes, runner))
        return {1: 0.001 if runner.path == winner else 0.002}

    monkeypatch.setattr("dspark.bench.prior.measure_draft_overhead", fake)
    target = FastTarget(_model(), path="packed")
    drafter = _drafter(target, "dflash")
    choice = choose_draft_runner(target, drafter, [torch.tensor(PROMPTS[0])], FLAT,
                                 candidates=("eager", "onnxruntime"))
    assert [(p, n) for p, n, _r in calls] == [("eager", 1), ("eager", 3), ("onnxruntime", 1), ("onnxruntime", 3)]
    assert choice.runner == winner and choice.overhead_seconds == {**{"eager": 0.002, "onnxruntime": 0.002}, winner: 0.001}
    timed = {path: r for path, _p, r in calls}
    assert drafter.loop.runner is timed[winner]
    assert choice.reason.startswith(f"draft round on the {winner} runner: eager ")


# -- the sequential head's opt-in survival floor (DraftingLoop.survival_floor) ---------------

FLOOR = 0.2  # the tiny random drafter's confidences sit near σ(0): its drafts end after a few steps


def test_the_survival_floor_cuts_each_draft_where_its_survival_falls_below_it():
    """Replayed engine contexts through the drafter without and with a floor: every draft ends at
    the first position whose survival Π σ(confidence logit) is below the floor, and what precedes
    it is the same (tokens, logits, confidence logits, hidden states)."""
    model = _model()
    target = FastTarget(model, path="packed")
    dname = "dspark:gated-markov+confidence"
    contexts = _contexts(target, _ort_drafter(target, dname))
    whole, floored = _ort_drafter(target, dname), _ort_drafter(target, dname)
    floored.loop.survival_floor = FLOOR
    cut_somewhere = stopped_early = False
    for context in contexts:
        a, b = whole.draft(context), floored.draft(context)
        below = torch.cumprod(torch.sigmoid(a.confidence_logits), 1) < FLOOR  # [R, γ]
        ends = torch.where(below.any(1), below.float().argmax(1), torch.full_like(a.valid_lengths, 4))
        assert torch.equal(b.valid_lengths, torch.minimum(a.valid_lengths, ends))
        cut_somewhere |= bool((b.valid_lengths < a.valid_lengths).any())
        stopped_early |= bool((b.confidence_logits == -30.0).any())
        for r, n in enumerate(b.valid_lengths.tolist()):
            assert torch.equal(b.tokens[r, :n], a.tokens[r, :n])
            torch.testing.assert_close(b.draft_logits[r, :n], a.draft_logits[r, :n])
            torch.testing.assert_close(b.confidence_logits[r, :n], a.confidence_logits[r, :n])
        torch.testing.assert_close(b.hidden, a.hidden)
    assert cut_somewhere and stopped_early  # the floor did cut drafts, and did end rounds early


@pytest.mark.parametrize("sched", ["full", "sps-greedy"])
def test_the_engine_with_a_survival_floor_is_greedy_identical(sched):
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _ort_drafter(target, "dspark:gated-markov+confidence")
    drafter.loop.survival_floor = FLOOR
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler(sched), cost_model=FLAT, clock=TickClock())
    prompts = [torch.tensor(p) for p in PROMPTS]
    rids, done = run_with_late_join(engine, prompts, 20)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p, 20), f"{sched}: {rid} diverged"
    assert sum(c.metrics["accepted"] for c in done.values()) > 0


def test_sampling_with_a_survival_floor_matches_the_target():
    """Ending a draft on its confidences is a stopping rule: the sampled law stays the target's."""
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _ort_drafter(target, "dspark:gated-markov+confidence")
    drafter.loop.survival_floor = FLOOR
    _assert_sampling_keeps_the_target_law(model, target, drafter, "full", "survival floor / T1")


def test_graph_calls_watch_a_runner_and_give_it_back():
    """GraphCalls (what the benchmarks watch a round with): one entry per graph call, the inputs
    cloned, a watch inside another, and the runner's own run back on exit."""
    target = FastTarget(_model(), path="packed")
    drafter = _ort_drafter(target, "dspark:gated-markov+confidence")
    context = _contexts(target, _ort_drafter(target, "dspark:gated-markov+confidence"))[0]
    runner = drafter.loop.runner
    with GraphCalls(runner, keep_inputs=True) as outer:
        with GraphCalls(runner) as inner:
            drafter.draft(context)
        assert "run" in vars(runner)  # the outer watch is back
    assert "run" not in vars(runner)  # the class's own run is back
    assert inner.count("backbone") == outer.count("backbone") == 1
    assert inner.count("head") == outer.count("head") == drafter.gamma
    assert inner.inputs == {} and set(outer.inputs) == {"context", "backbone", "head"}
    anchors = outer.inputs["backbone"]["anchor_ids"]
    assert torch.equal(anchors, torch.stack([ids[-1] for ids in context.token_ids]))
    assert all(s > 0 for s in outer.seconds["backbone"])


def _linear_calls(fn, *args) -> int:
    """How many linear products dynamo's graph of ``fn(*args)`` holds (a counting backend, run eager)."""
    seen = []

    def count(gm, example_inputs):
        seen.append(sum(n.op == "call_function" and n.target is torch._C._nn.linear for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=count, fullgraph=True)(*args)
    return sum(seen)


def test_a_draft_layers_products_fuse_only_when_compiled_for_inference():
    """`products`: one product over the concatenated weights inside a compiled CPU inference graph,
    with the separate products' values; one product each eager and with gradients."""
    from dspark.drafters.layers import products

    torch.manual_seed(0)
    linears = [torch.nn.Linear(16, n, bias=False) for n in (8, 4, 4)]
    x = torch.randn(2, 3, 16)

    def run(x):
        return products(x, *linears)

    separate = tuple(m(x) for m in linears)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(run(x), separate))  # eager: each its own product
        assert _linear_calls(run, x) == 1
        fused = torch.compile(run, backend="eager", fullgraph=True)(x)
    for a, b in zip(fused, separate):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert _linear_calls(run, x) == 3  # gradients on: training keeps its own graph
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_equals_attention_over_repeated_kv_heads(dtype):
    """`attend` runs the query heads of one K/V head as one taller head: bit-equal to the kernel
    over K/V heads repeated H / H_kv times (the brute-force form), masks included."""
    import torch.nn.functional as F

    from dspark.drafters.layers import attend

    g = torch.Generator().manual_seed(0)
    R, H, H_kv, rows, P, hd = 2, 9, 3, 7, 40, 16
    q, k, v = (torch.randn(R, h, n, hd, generator=g).to(dtype) for h, n in ((H, rows), (H_kv, P), (H_kv, P)))
    mask = torch.rand(R, rows, P, generator=g) > 0.3
    mask[..., 0] = True
    rep = H // H_kv
    brute = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=mask[:, None])
    assert torch.equal(attend(q, k, v, mask), brute)


#: one request's rows of a draft graph's call, read from its inputs by hand (None: several requests)
_ROWS_BY_HAND = {
    "context": lambda x: x["features"].shape[0] if "features" in x else x["token_ids"].shape[0],
    "fuse": lambda x: x["features"].shape[0],
    "backbone": lambda x: x["positions"].shape[1] if x["positions"].shape[0] == 1 else None,
    "step": lambda x: x["token_ids"].shape[1] if x["token_ids"].shape[0] == 1 else None,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bound", [2, 5])
@pytest.mark.parametrize("dname", ["dspark:gated-markov", "eagle3"])
def test_a_compiled_drafters_calls_take_the_gemm_template_by_their_rows(dname, bound, dtype, monkeypatch):
    """Each compiled CPU draft graph call is compiled with the template's settings exactly where it
    drafts for one request with at most few_rows() rows in bf16 (oneDNN elsewhere: several
    requests, more rows, fp32), and its several-row axis is bounded to that class. The compile
    is replaced by a recorder that reads inductor's settings as a compile would and runs the graph
    eagerly; engine rounds at one and at two requests, with contexts long and short."""
    import torch._inductor.config as inductor_config

    from dspark.fast import compile as compiling

    monkeypatch.setattr(compiling, "few_rows", lambda: bound)
    seen = []

    def recorder(module):
        def run(**inputs):
            ranges = {(name, r.dim): (r.min, r.max) for name, t in inputs.items()
                      for r in getattr(t, "_dynamo_dynamic_range", ())}
            seen.append((type(module).__name__, {k: tuple(v.shape) for k, v in inputs.items()},
                         inductor_config.max_autotune_gemm_backends, ranges, inputs))
            return module(**inputs)
        return run

    monkeypatch.setattr(compiling, "compile_step", lambda module, device, graph_options=None, **_: compiling._Patched(
        recorder(module), compiling.CPU_OPTIONS, graph_options))
    target = FastTarget(_model().to(dtype), path="packed")
    drafter = _drafter(target, dname).to(dtype)
    assert use_draft_runner(drafter, "compiled") == "compiled"
    names = {type(g.module).__name__: g.name for g in drafter.graph_specs(drafter, live=True)}
    _contexts(target, drafter)  # a late join: rounds of one and of two requests
    default = compiling.AUTOTUNE_OPTIONS["max_autotune_gemm_backends"]
    calls = {"template": 0, "oneDNN": 0}
    for module, shapes, backends, ranges, inputs in seen:
        graph = names[module]
        rows = _ROWS_BY_HAND[graph](inputs)
        template = dtype == torch.bfloat16 and rows is not None and rows <= bound
        calls["template" if template else "oneDNN"] += 1
        assert (backends == "CPP") == template, (graph, shapes, backends)
        assert backends in ("CPP", default) or not template
        if rows is not None and rows > 1:  # the row axis is bounded to its class
            lo_hi = (2, bound) if template else (bound + 1 if dtype == torch.bfloat16 else 2,
                                                 max(compiling.MOST_ROWS, rows))
            assert ranges and all(r == lo_hi for r in ranges.values()), (graph, shapes, ranges)
        else:
            assert not ranges, (graph, shapes, ranges)
    assert calls["oneDNN"] > 0 and (calls["template"] > 0) == (dtype == torch.bfloat16), calls
    assert drafter.loop.runner.path == "compiled"


def test_a_compiled_bf16_drafter_runs_on_the_template_and_drafts_what_the_eager_one_does():
    """The real compile: a bf16 drafter's graphs of one request's few rows on the GEMM template and
    the rest on oneDNN, at one request and at two, without falling back to eager (the row bounds
    hold for the real graphs), and its blocks' logits equal the eager bf16 drafter's to bf16's rounding."""
    from dspark.fast.linear import bf16_packing_supported

    if not bf16_packing_supported():
        pytest.skip("this CPU's oneDNN has no bf16 products (no AVX-512 or AVX-NE-CONVERT): no bf16 compiled drafter")
    target = FastTarget(_model().to(torch.bfloat16), path="packed")
    eager = _drafter(target, "dspark:gated-markov").to(torch.bfloat16)
    compiled = _drafter(target, "dspark:gated-markov").to(torch.bfloat16)
    assert use_draft_runner(compiled, "compiled") == "compiled"
    contexts = _contexts(target, eager)
    assert {len(c.request_ids) for c in contexts} >= {1, 2}
    with torch.inference_mode():
        for context in contexts:
            a, b = eager.draft(context), compiled.draft(context)
            # a position's logits read the drafts before it: compare up to the first that differs
            same = torch.cumprod((a.tokens == b.tokens).long(), 1)  # [R, γ]
            upto = torch.cat([torch.ones_like(same[:, :1]), same[:, :-1]], 1).bool()  # [R, γ]
            torch.testing.assert_close(b.draft_logits.float()[upto], a.draft_logits.float()[upto],
                                       atol=0.15, rtol=0.05)
    assert compiled.loop.runner.path == "compiled"
