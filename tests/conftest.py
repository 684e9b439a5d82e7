"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny-model tests on one torch thread, then restore the setting.

    Tiny forwards are dominated by per-op overhead; on a busy 2-core machine thread spin-waiting
    made them ~200× slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_with_late_join(engine, prompts, max_new_tokens):
    """Two requests start, run two rounds, a third joins mid-stream; all run to completion.

    Returns (request ids in prompt order, {request id: Completion}).
    """
    rids = [engine.add_request(p, max_new_tokens=max_new_tokens) for p in prompts[:2]]
    engine.step()
    engine.step()
    rids.append(engine.add_request(prompts[2], max_new_tokens=max_new_tokens))  # joins mid-stream
    for _ in engine.stream():
        pass
    return rids, {c.request_id: c for c in engine.pop_finished()}


def tiny_causal_lm(arch: str = "llama", *, vocab_size: int = 32, num_layers: int = 4, max_positions: int = 128,
                   init_range: float = 0.3, seed: int = 0):
    """A tiny randomly initialised HF causal LM (d = 32, 4 heads, 2 KV heads) without EOS, so
    greedy decodes run to max_new_tokens."""
    torch.manual_seed(seed)
    cls = LlamaConfig if arch == "llama" else Qwen3Config
    cfg = cls(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
              initializer_range=init_range)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def greedy_decode(model, prompt: torch.Tensor, n: int) -> list[int]:
    """The HF model's own greedy continuation of ``prompt`` [n_prompt]: n new token ids."""
    out = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, prompt.numel():].tolist()


def exact_two_token_probs(model, prompt: torch.Tensor, params):
    """Exact joint law P(x1, x2) [V·V] (flat index x1·V + x2, float64 numpy) of the first two
    tokens under plain target sampling of the HF ``model`` after ``prompt`` [n_prompt], with the
    same temperature / top-k / top-p as the engine (``dspark.sampling.probs_for_requests``)."""
    from dspark.sampling import probs_for_requests

    with torch.no_grad():
        p1 = probs_for_requests(model(prompt[None]).logits[:, -1], [params])[0]  # [V]
        V = p1.numel()
        seqs = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)  # [V, n_prompt + 1]
        p2 = probs_for_requests(model(seqs).logits[:, -1], [params] * V)  # [V, V]
    return (p1.double()[:, None] * p2.double()).reshape(-1).numpy()


def record_rounds(engine) -> list:
    """Collect ``engine.last_round`` (RoundInfo) after every step of ``engine``."""
    rounds, step = [], engine.step

    def recorded():
        out = step()
        if engine.last_round is not None:
            rounds.append(engine.last_round)
        return out

    engine.step = recorded
    return rounds
