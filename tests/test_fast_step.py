"""The fast target step (dspark.fast): the packed and compiled paths against the HF forward.

* :class:`FastTarget` through a stream of joins, drafts, rollbacks and leaves equals
  :class:`HFTarget` (logits and captured features), for Llama and Qwen3;
* the engine on each path is greedy-identical to the model's own decode, and samples the target's
  law (χ²), for drafters × schedulers;
* bf16 with prepacked weights equals bf16 without them;
* the fallbacks: a model the step does not cover runs the HF forward, a compile that cannot run
  here runs the packed step — each said in one logged sentence.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import dspark
from dspark.engine import Engine
from dspark.fast import FastTarget, build_target
from dspark.fast import target as fast_target
from dspark.fast.compile import FEW_ROWS, FEW_ROWS_AMX, CompileUnavailable
from dspark.targets import HFTarget
from dspark.types import SamplingParams
from helpers import (
    TickClock,
    assert_same_distribution,
    exact_two_token_probs,
    greedy_decode,
    record_rounds,
    run_with_late_join,
    sequence_counts,
    tiny_causal_lm,
)

pytestmark = pytest.mark.usefixtures("one_thread")

V = 16


def _tiny(arch: str, vocab: int = V, **kw):
    return tiny_causal_lm(arch, vocab_size=vocab, max_positions=96, num_layers=3, init_range=0.3,
                          head_dim=8 if arch == "qwen3" else None, **kw)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return _tiny(request.param)


def _same(a, b, capture, atol=1e-4):
    torch.testing.assert_close(a.logits, b.logits, atol=atol, rtol=atol)
    assert a.lengths.tolist() == b.lengths.tolist()
    for k in capture:
        torch.testing.assert_close(a.hidden_states[k], b.hidden_states[k], atol=atol, rtol=atol)


@pytest.mark.parametrize("path", ["packed", "compiled"])
def test_fast_target_equals_hf_target_through_a_stream(model, path):
    """Prefill of lengths 1, 5, 30; verify with ℓ ∈ 0..4, random rollbacks, a join and a leave;
    one request alone at the end (the in-place R = 1 path)."""
    capture = (0, 2)
    ref, fast = HFTarget(model, capture_layers=capture), FastTarget(model, capture_layers=capture, path=path)
    assert fast.path == path and ref.path == "eager"
    g = torch.Generator().manual_seed(3)
    live: list[str] = []

    def join(lengths: dict[str, int]) -> None:
        prompts = [torch.randint(V, (n,), generator=g) for n in lengths.values()]
        _same(fast.prefill(list(lengths), prompts), ref.prefill(list(lengths), prompts), capture)
        live.extend(lengths)

    join({"a": 1, "b": 5, "c": 30})
    for rnd in range(6):
        if rnd == 2:
            join({"d": 17})
        if rnd == 4:
            fast.release("b")
            ref.release("b")
            live.remove("b")
        ells = torch.tensor([(i + rnd) % 5 for i in range(len(live))])
        tokens = torch.randint(V, (len(live), 5), generator=g)
        _same(fast.verify(live, tokens, ells), ref.verify(live, tokens, ells), capture)
        keep = torch.tensor([ref.cached_length(r) - int(torch.randint(int(e) + 1, (1,), generator=g))
                             for r, e in zip(live, ells)])
        fast.rollback(live, keep)
        ref.rollback(live, keep)
        assert [fast.cached_length(r) for r in live] == keep.tolist()
    for ells in ([2], [0], [4]):
        tokens = torch.randint(V, (1, 5), generator=g)
        _same(fast.verify(["c"], tokens, torch.tensor(ells)), ref.verify(["c"], tokens, torch.tensor(ells)), capture)
    fast.set_capture_layers(())  # the engine switches capture off in skipped rounds
    ref.set_capture_layers(())
    tokens = torch.randint(V, (1, 3), generator=g)
    out = fast.verify(["c"], tokens, torch.tensor([2]))
    assert out.hidden_states is None
    torch.testing.assert_close(out.logits, ref.verify(["c"], tokens, torch.tensor([2])).logits, atol=1e-4, rtol=1e-4)
    lean = fast.prefill(["e"], [torch.arange(6)], logits=False)
    assert lean.logits.shape == (1, 0, V)
    assert fast.path == path  # no silent fallback to another path


FLAT = dspark.get_cost_model("sps-table", profile={
    "device": "test", "model": "tiny", "dtype": "float32", "date": "2026-11-30", "accounting": "packed",
    "points": [{"batch_size": 1, "step_seconds": 1e-4}, {"batch_size": 65536, "step_seconds": 1.01e-4}]})


def _drafter(target, name: str):
    torch.manual_seed(1)
    if name == "ngram":
        return dspark.get_drafter("ngram", vocab_size=target.vocab_size, gamma=4)
    kind, _, head = name.partition(":")
    cfg = {"gamma": 4, "num_layers": 2} if kind != "eagle3" else {"gamma": 4}
    if head:
        cfg.update(head=head, rank=8)
    d = dspark.get_drafter(kind, target=target, **cfg)
    for p in d.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.2)
    return d


PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [1], [2, 9, 4, 4, 11, 2, 9, 4, 4, 11, 2, 9, 13, 6, 1, 2, 9, 4]]


@pytest.mark.parametrize("path", ["packed", "compiled"])
@pytest.mark.parametrize("dname,sched", [("ngram", "full"), ("dspark:gated-markov", "sps-greedy"),
                                         ("dflash", "fixed"), ("eagle3", "sps-greedy")])
def test_engine_on_the_fast_path_is_greedy_identical(model, path, dname, sched):
    target = FastTarget(model, path=path)
    engine = Engine(target, _drafter(target, dname), scheduler=dspark.get_scheduler(sched), cost_model=FLAT,
                    clock=TickClock())
    infos = record_rounds(engine)
    prompts = [torch.tensor(p) for p in PROMPTS]
    rids, done = run_with_late_join(engine, prompts, 20)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p, 20), f"{path}/{dname}/{sched}: {rid} diverged"
    assert any(i.drafted and sum(i.lengths) > 0 for i in infos), "no draft was verified"
    assert list(target.request_ids) == []
    assert target.path == path  # no silent fallback to another path


@pytest.mark.parametrize("path", ["packed", "compiled"])
@pytest.mark.parametrize("dname,pname", [("dspark:gated-markov", "T1"), ("eagle3", "T1.3-topk8")])
def test_sampling_on_the_fast_path_matches_the_target(path, dname, pname):
    """Joint law of the first two sampled tokens = plain target sampling (χ², fixed seeds)."""
    params = {"T1": SamplingParams(temperature=1.0),
              "T1.3-topk8": SamplingParams(temperature=1.3, top_k=8)}[pname]
    model = _tiny("llama")
    target = FastTarget(model, path=path)
    engine = Engine(target, _drafter(target, dname), scheduler=dspark.get_scheduler("sps-greedy"),
                    cost_model=FLAT, seed=11, clock=TickClock())
    prompt = torch.tensor([7, 13, 11, 7, 13, 11, 7, 13])
    out = engine.generate([prompt] * 1500, params, max_new_tokens=3, progress=False)
    tokens = torch.tensor([c.output_ids[:2] for c in out])
    assert_same_distribution(sequence_counts(tokens, V), exact_two_token_probs(model, prompt, params),
                             f"{path}/{dname}/{pname}", exact_support=False)
    assert sum(c.metrics["accepted"] for c in out) > 0
    assert target.path == path


def test_packed_bf16_equals_unpacked_bf16():
    model = _tiny("llama", vocab=64, hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    packed = FastTarget(model, path="packed")
    if not any(layer.qkv.pack for layer in packed._step.layers):
        pytest.skip("oneDNN cannot pack bf16 weights on this build of torch")
    plain = FastTarget(_tiny("llama", vocab=64, hidden_size=64, intermediate_size=128).to(torch.bfloat16),
                       path="packed")
    for layer in [*plain._step.layers, plain._step.lm_head]:  # the same weights, unpacked
        for lin in ([layer] if layer is plain._step.lm_head else [layer.qkv, layer.o, layer.gate_up, layer.down]):
            lin.pack = False
    prompt = torch.arange(20) % 64
    a = packed.prefill(["a"], [prompt])
    b = plain.prefill(["a"], [prompt])
    torch.testing.assert_close(a.logits.float(), b.logits.float(), atol=0.05, rtol=0.05)
    tokens = torch.tensor([[3, 4, 5, 6]])
    a = packed.verify(["a"], tokens, torch.tensor([3]))
    b = plain.verify(["a"], tokens, torch.tensor([3]))
    torch.testing.assert_close(a.logits.float(), b.logits.float(), atol=0.05, rtol=0.05)


def test_unsupported_model_falls_back_to_the_hf_forward_in_one_sentence(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                          bos_token_id=0, eos_token_id=0)).eval()
    with pytest.raises(NotImplementedError, match="fast step covers .* not 'gpt2'"):
        FastTarget(gpt2)
    with caplog.at_level(logging.WARNING, logger="dspark.fast.target"):
        target = build_target(gpt2, path="compiled")
    assert type(target) is HFTarget and target.path == "eager"
    (record,) = [r for r in caplog.records if r.name == "dspark.fast.target"]
    assert "not 'gpt2'" in record.getMessage() and "HF forward" in record.getMessage()


def test_compile_unavailable_falls_back_to_the_packed_step(monkeypatch, caplog):
    model = _tiny("llama")

    def broken(step, device, **kw):
        raise CompileUnavailable("torch.compile failed on cpu (CalledProcessError: no C++ compiler)")

    monkeypatch.setattr("dspark.fast.compile.compile_step", broken)
    monkeypatch.setattr(fast_target, "_STEPS", type(fast_target._STEPS)())
    with caplog.at_level(logging.WARNING, logger="dspark.fast.target"):
        target = build_target(model, path="compiled")
    assert isinstance(target, FastTarget) and target.path == "packed"
    (record,) = [r for r in caplog.records if r.name == "dspark.fast.target"]
    assert "no C++ compiler" in record.getMessage() and "packed eager step" in record.getMessage()
    out = target.prefill(["a"], [torch.tensor([1, 2, 3])])
    torch.testing.assert_close(out.logits, HFTarget(model).prefill(["a"], [torch.tensor([1, 2, 3])]).logits,
                               atol=1e-4, rtol=1e-4)


def test_a_compiler_that_fails_is_reported_as_unavailable(monkeypatch):
    """check_compiler turns an inductor failure on a two-op function into CompileUnavailable
    (once per device type: the answer is kept)."""
    from dspark.fast import compile as fast_compile

    def fake_compile(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx")
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(fast_compile, "_CHECKED", {})
    for _ in range(2):
        with pytest.raises(CompileUnavailable, match="cannot run on cpu here .RuntimeError: InvalidCxxCompiler"):
            fast_compile.check_compiler(torch.device("cpu"))


def test_a_model_whose_compile_fails_runs_the_packed_step(caplog):
    model = _tiny("llama")
    target = FastTarget(model, path="compiled")

    def failing(*args):
        raise RuntimeError("LoweringException: an op inductor cannot lower")

    target._run = failing
    prompt = torch.tensor([3, 1, 4, 1, 5])
    ref = HFTarget(model)
    ref.prefill(["a"], [prompt])
    target.prefill(["a"], [prompt])
    with caplog.at_level(logging.WARNING, logger="dspark.fast.target"):
        out = target.verify(["a"], torch.tensor([[9, 2, 6]]), torch.tensor([2]))
    (record,) = [r for r in caplog.records if r.name == "dspark.fast.target"]
    assert "LoweringException" in record.getMessage() and "packed step" in record.getMessage()
    assert target.path == "packed"
    torch.testing.assert_close(out.logits, ref.verify(["a"], torch.tensor([[9, 2, 6]]), torch.tensor([2])).logits,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_step_weight_bytes_count_what_a_step_reads(tied):
    """Every parameter once; an untied input embedding is not read (a step gathers a few rows)."""
    from dspark.profiling import step_weight_bytes, traffic_floor

    model = tiny_causal_lm("llama", vocab_size=64, tied=tied)
    every = sum(p.numel() * 4 for p in model.parameters())  # parameters() lists a tied weight once
    embed = 64 * 32 * 4
    assert step_weight_bytes(model) == (every if tied else every - embed)
    floor = traffic_floor(model, bandwidth=1e9)
    assert floor["floor_seconds"] == pytest.approx(step_weight_bytes(model) / 1e9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
@pytest.mark.parametrize("path", ["packed", "compiled"])
def test_fast_paths_on_cuda_are_greedy_identical(path):
    """On a GPU (compiled: CUDA graphs): the engine decodes what the model's own generate does,
    fp32, requests joining mid-stream."""
    model = _tiny("llama").to("cuda")
    target = FastTarget(model, path=path)
    engine = Engine(target, None, cost_model=FLAT, clock=TickClock())
    prompts = [torch.tensor(p) for p in PROMPTS]
    rids, done = run_with_late_join(engine, prompts, 16)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p.to("cuda"), 16), f"{path}: {rid} diverged"
    assert target.path == path


def test_inference_linear_packs_bf16_and_repacks_a_changed_weight():
    from dspark.fast.linear import inference_linear, packs

    torch.manual_seed(0)
    w = torch.randn(48, 32).bfloat16()
    x = torch.randn(5, 32).bfloat16()
    with torch.inference_mode():
        if not packs(x, w):
            pytest.skip("oneDNN cannot pack bf16 weights on this build of torch")
        a = inference_linear(x, w)
        torch.testing.assert_close(a.float(), torch.nn.functional.linear(x, w).float(), atol=0.05, rtol=0.02)
        w.mul_(2)  # changed in place: the packed copy must follow
        torch.testing.assert_close(inference_linear(x, w).float(), 2 * a.float(), atol=0.1, rtol=0.02)
    assert not packs(x.float(), w.float())  # fp32: F.linear as written
    with torch.enable_grad():
        assert not packs(x, w.requires_grad_())  # training: never the packed route


def test_a_cpu_that_cannot_pack_bf16_runs_the_products_as_written(monkeypatch, caplog):
    """Without AVX-512 (an AVX2-only CPU) oneDNN's bf16 packing raises: the probe declines the packed
    route once, in one logged sentence, and the packed step path still runs, with plain products."""
    import dspark.fast.linear as lin

    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(lin, "_reorder", refuse)
    lin.bf16_packing_supported.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="dspark.fast.linear"):
            w = torch.randn(48, 32).bfloat16()
            assert not lin.can_pack(w) and not lin.Linear(w, pack=True).pack
        assert [r.getMessage() for r in caplog.records] == [
            "bf16 weights are not prepacked on this CPU (mkldnn_reorder_linear_weight: bf16 path needs the cpu "
            "support avx512bw); products run as written"]
        model = _tiny("llama", vocab=64, hidden_size=64, intermediate_size=128).to(torch.bfloat16)
        packed = FastTarget(model, path="packed")
        assert not any(layer.qkv.pack for layer in packed._step.layers)
        with torch.inference_mode():
            x = torch.randn(5, 32).bfloat16()
            assert torch.equal(lin.inference_linear(x, w), torch.nn.functional.linear(x, w))
        prompt = torch.arange(20) % 64  # oracle: the fp32 HF forward; bf16 error no worse than HF's own
        exact = HFTarget(copy.deepcopy(model).float()).prefill(["a"], [prompt]).logits.float()
        hf_err = (HFTarget(model).prefill(["a"], [prompt]).logits.float() - exact).abs().max()
        fast_err = (packed.prefill(["a"], [prompt]).logits.float() - exact).abs().max()
        assert fast_err <= 2 * hf_err + 0.01, (fast_err, hf_err)
    finally:
        monkeypatch.undo()
        lin.bf16_packing_supported.cache_clear()


def test_the_engine_routes_a_bf16_drafters_linears_through_packed_weights():
    """The engine sends a drafter's linears and its LM head product through packed weights (bf16,
    CPU): the same products within bf16 rounding."""
    from dspark.fast.linear import packs

    model = _tiny("llama", vocab=64, hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    target = FastTarget(model, path="packed")
    drafter = _drafter(target, "dspark:gated-markov")
    Engine(target, drafter, scheduler=dspark.get_scheduler("full"), cost_model=FLAT, clock=TickClock())
    routed = [m for m in drafter.modules() if type(m) is torch.nn.Linear]
    assert routed and all("forward" in m.__dict__ for m in routed)
    torch.manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(3, routed[0].in_features).bfloat16()
        if not packs(x, routed[0].weight):
            pytest.skip("oneDNN cannot pack bf16 weights on this build of torch")
        torch.testing.assert_close(routed[0](x).float(), torch.nn.functional.linear(x, routed[0].weight).float(),
                                   atol=0.05, rtol=0.02)
        h = torch.randn(2, 4, 64).bfloat16()
        torch.testing.assert_close(drafter.logits(h).float(), (h @ drafter._lm_head.T).float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("bound", [FEW_ROWS, FEW_ROWS_AMX])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_step_compiles_each_shape_class_once(dtype, bound, monkeypatch):
    """One request decoding across several cache buckets, then drafting blocks: one graph for
    q = 1 and, in bf16, one for 1 < q ≤ few_rows() (the GEMM template's) and one above (oneDNN's);
    in fp32 one for every q > 1 (all oneDNN) — however long the context grows and in whatever
    order the widths come, at either bound (without AMX and with it). The bucket equals the head
    dimension, the coincidence (T = d at the first call) that once made T a constant; and the
    cache grows under the read view, whose strides once compiled a second graph."""
    from torch._dynamo.utils import counters

    from dspark.fast.linear import bf16_packing_supported

    monkeypatch.setattr("dspark.fast.compile.few_rows", lambda: bound)

    if dtype == torch.bfloat16 and not bf16_packing_supported():
        pytest.skip("this CPU's oneDNN has no bf16 products (no AVX-512 or AVX-NE-CONVERT): no bf16 compiled step")
    model = tiny_causal_lm("llama", vocab_size=V, max_positions=256, num_layers=3, init_range=0.3).to(dtype)
    d = model.config.hidden_size // model.config.num_attention_heads
    target = FastTarget(model, path="compiled", bucket=d)
    tol = 1e-4 if dtype == torch.float32 else 0.25  # bf16: a sanity check (roundings differ); values are fp32's test
    ref = HFTarget(model)
    g = torch.Generator().manual_seed(5)
    prompt = [torch.randint(V, (3,), generator=g)]
    _same(target.prefill(["a"], prompt), ref.prefill(["a"], prompt), (), tol)
    graphs = [counters["stats"]["unique_graphs"]]
    widths = ((1,), (bound,), (bound + 2,), (2, bound + 1, 3, 2 * bound))
    for qs, steps in zip(widths, (5 * d, 2 * d, 2 * d, 2 * d)):  # the cache crosses several buckets of d positions
        for i in range(max(len(qs), steps // max(qs))):  # each width at least once
            q = qs[i % len(qs)]
            tokens = torch.randint(V, (1, q), generator=g)
            ells = torch.tensor([q - 1])
            _same(target.verify(["a"], tokens, ells), ref.verify(["a"], tokens, ells), (), tol)
        graphs.append(counters["stats"]["unique_graphs"])
    several = [1, 1, 0] if dtype == torch.bfloat16 else [1, 0, 0]
    assert [b - a for a, b in zip(graphs, graphs[1:])] == [1, *several], f"graphs compiled by then: {graphs}"
    assert target.path == "compiled"


def test_the_compiled_step_guards_its_capture_set_but_not_its_weights():
    """dynamo checks no guard on the step's frozen weights before a call (drop_weight_guards), but
    keeps those on the step's own attributes: a target that starts capturing layers mid-stream
    compiles a graph that returns them, equal to the HF forward's."""
    from torch._dynamo.utils import counters

    from dspark.fast.compile import drop_weight_guards, own_forward

    model = tiny_causal_lm("llama", vocab_size=V, max_positions=64, num_layers=3, init_range=0.3)
    fast, ref = FastTarget(model, path="compiled"), HFTarget(model)
    kept: list[list[str]] = []

    def recording(entries):
        keep = drop_weight_guards(entries)
        kept.append([e.name for e, k in zip(entries, keep) if k])
        return keep

    fast._run.fn = torch.compile(own_forward(fast._step), dynamic=True, fullgraph=True,
                                 options={"guard_filter_fn": recording})
    g = torch.Generator().manual_seed(4)
    prompt = [torch.randint(V, (5,), generator=g)]
    _same(fast.prefill(["a"], prompt), ref.prefill(["a"], prompt), ())
    tokens = torch.randint(V, (1, 1), generator=g)
    _same(fast.verify(["a"], tokens, torch.tensor([0])), ref.verify(["a"], tokens, torch.tensor([0])), ())
    before = counters["stats"]["unique_graphs"]
    for target in (fast, ref):
        target.set_capture_layers((0, 2))
    tokens = torch.randint(V, (1, 1), generator=g)
    _same(fast.verify(["a"], tokens, torch.tensor([0])), ref.verify(["a"], tokens, torch.tensor([0])), (0, 2))
    assert counters["stats"]["unique_graphs"] == before + 1, "a new capture set compiles a new graph"
    assert kept and all("self.graph_capture" in names for names in kept)
    weights = [n for names in kept for n in names if n.startswith(("self._modules", "self._parameters"))]
    assert not weights, f"guards on frozen weights were kept: {weights[:3]}"


def test_two_compiled_models_of_one_shape_never_share_a_graph():
    """Without guards on the weights, only the code object of its own (own_forward) keeps a model
    from running another model's frozen graph: two models of one shape and dtype, stepped in turn,
    each equal their own HF forward."""
    models = [tiny_causal_lm("llama", vocab_size=V, max_positions=64, num_layers=2, init_range=0.3, seed=s)
              for s in (11, 12)]
    fast = [FastTarget(m, path="compiled") for m in models]
    ref = [HFTarget(m) for m in models]
    g = torch.Generator().manual_seed(6)
    prompt = [torch.randint(V, (4,), generator=g)]
    for f, r in zip(fast, ref):
        _same(f.prefill(["a"], prompt), r.prefill(["a"], prompt), ())
    for _ in range(3):
        tokens = torch.randint(V, (1, 1), generator=g)
        outs = [f.verify(["a"], tokens, torch.tensor([0])) for f in fast]
        for out, r in zip(outs, ref):
            _same(out, r.verify(["a"], tokens, torch.tensor([0])), ())
        assert not torch.allclose(outs[0].logits, outs[1].logits), "the two models must differ"
    assert all(f.path == "compiled" for f in fast)


def test_own_forward_copies_a_plain_forward_and_declines_any_other():
    """own_forward gives a module's forward a code object of its own, bound to it and computing the
    same; a forward that is not a plain function gets None (compile_step then keeps torch's guards)."""
    from dspark.fast.compile import own_forward

    lin = torch.nn.Linear(3, 2)
    own = own_forward(lin)
    x = torch.randn(4, 3)
    assert own.__func__.__code__ is not torch.nn.Linear.forward.__code__
    torch.testing.assert_close(own(x), lin(x))

    class Twice:
        def __call__(self, x):
            return 2 * x

    class Odd(torch.nn.Module):
        forward = Twice()  # a callable object, not a function

    torch.testing.assert_close(Odd()(x), 2 * x)
    assert own_forward(Odd()) is None


@pytest.mark.parametrize("bound", [FEW_ROWS, FEW_ROWS_AMX])
def test_each_row_class_compiles_with_its_own_gemm_settings(bound, monkeypatch):
    """A compiled graph's settings are read when it compiles: every CPU graph gets the C++ wrapper
    and weight freezing; in bf16 one request's one token and its 2 … few_rows() tokens (a class
    bounded in its row count) take the GEMM template, in fp32 its one token autotunes its products,
    and the rest keep oneDNN."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr("dspark.fast.compile.few_rows", lambda: bound)

    model = tiny_causal_lm("llama", vocab_size=V, max_positions=64, num_layers=2)
    target = FastTarget(model, path="compiled")
    run = target._run
    seen = []

    def record(tokens, *rest):  # stands in for the compiled graph: what a compile would read
        seen.append((tuple(tokens.shape), inductor_config.freezing, inductor_config.cpp_wrapper,
                     inductor_config.max_autotune, inductor_config.max_autotune_gemm_backends))
        return target._step(tokens, *rest[:3], target._step.graph_capture, *rest[4:])

    run.fn = record
    g = torch.Generator().manual_seed(3)
    target.prefill(["a", "b"], [torch.randint(V, (3,), generator=g) for _ in range(2)])
    default_backends = inductor_config.max_autotune_gemm_backends
    cases = ((["a"], 1), (["a"], 2), (["a"], bound), (["a"], bound + 1), (["a", "b"], 1), (["a", "b"], 3))
    for rids, q in cases:
        tokens = torch.randint(V, (len(rids), q), generator=g)
        target.verify(rids, tokens, torch.full((len(rids),), q - 1))
    assert seen == [((1, 1), True, True, True, "CPP,ATEN"), ((1, 2), True, True, False, default_backends),
                    ((1, bound), True, True, False, default_backends),
                    ((1, bound + 1), True, True, False, default_backends),
                    ((2, 1), True, True, False, default_backends), ((2, 3), True, True, False, default_backends)]
    # in bf16 one token and the short verifications take the template
    bf16 = FastTarget(tiny_causal_lm("llama", vocab_size=V, max_positions=64, num_layers=2).to(torch.bfloat16),
                      path="compiled")
    bf16._run.fn, target, seen[:] = record, bf16, []
    bf16.prefill(["a"], [torch.randint(V, (3,), generator=g)])
    for q in (1, 2, bound, bound + 1):
        bf16.verify(["a"], torch.randint(V, (1, q), generator=g), torch.tensor([q - 1]))
    assert [s[-1] for s in seen] == ["CPP", "CPP", "CPP", default_backends]
    assert not inductor_config.max_autotune and not inductor_config.cpp_wrapper  # restored after each call


def test_bf16_short_verifications_compile_on_the_gemm_template_and_agree_with_the_packed_step():
    """The bf16 graphs of one and of 2 … few_rows() tokens compile with the template allowed alone
    (oneDNN wherever it does not apply) and computes what the packed eager step computes, to bf16's
    rounding; no fallback to another path."""
    from dspark.fast.compile import few_rows

    model = tiny_causal_lm("llama", vocab_size=V, max_positions=64, num_layers=2, init_range=0.3).to(torch.bfloat16)
    fast, ref = FastTarget(model, path="compiled"), FastTarget(model, path="packed")
    g = torch.Generator().manual_seed(11)
    prompt = [torch.randint(V, (5,), generator=g)]
    with torch.inference_mode():
        fast.prefill(["a"], prompt), ref.prefill(["a"], prompt)
        for q in (1, 2, few_rows(), 3):
            tokens = torch.randint(V, (1, q), generator=g)
            ells = torch.tensor([q - 1])
            a, b = fast.verify(["a"], tokens, ells), ref.verify(["a"], tokens, ells)
            torch.testing.assert_close(a.logits.float(), b.logits.float(), atol=0.1, rtol=0.05)
    assert fast.path == "compiled"


def test_few_rows_follows_the_instruction_set_inductor_compiles_for(monkeypatch):
    """The template's row bound: FEW_ROWS_AMX where inductor picks AMX tiles, FEW_ROWS for every
    other instruction set and where it finds none (no compiler)."""
    import torch._inductor.cpu_vec_isa as isa

    from dspark.fast import compile as compiling

    cases = ((isa.VecAMX(), FEW_ROWS_AMX), (isa.VecAVX512(), FEW_ROWS), (isa.VecAVX2(), FEW_ROWS),
             (isa.invalid_vec_isa, FEW_ROWS))
    try:
        for picked, expected in cases:
            monkeypatch.setattr(isa, "pick_vec_isa", lambda picked=picked: picked)
            compiling.few_rows.cache_clear()
            assert compiling.few_rows() == expected, type(picked).__name__
    finally:
        compiling.few_rows.cache_clear()
