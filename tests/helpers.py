"""Plain helpers shared by the tests (fixtures live in conftest.py).

* :func:`tiny_config` / :func:`tiny_causal_lm`: the one builder of tiny randomly initialised HF
  causal LMs (Llama or Qwen3); every size, the init range and the seed are parameters, so each
  test keeps the model it was written for. :func:`save_tiny_target` writes one to a folder with a
  word-level tokenizer (what ``load_target`` / the CLI accept).
* :func:`chi2_pvalue` / :func:`assert_same_distribution`: the one χ² goodness-of-fit test of
  sampled categories against exact probabilities (rare categories pooled);
  :func:`sequence_counts` turns sampled token sequences into category counts.
* Engine drivers and oracles: :func:`greedy_decode`, :func:`exact_two_token_probs`,
  :func:`record_rounds`, :func:`run_with_late_join`, :class:`TickClock`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from scipy import stats

# --------------------------------------------------------------------------------------------
# Tiny HF models
# --------------------------------------------------------------------------------------------


def tiny_config(
    arch: str = "llama",
    *,
    vocab_size: int = 32,
    num_layers: int = 4,
    max_positions: int = 128,
    init_range: float = 0.3,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    tied: bool = False,
    attn: str | None = None,
    **extra,
):
    """A tiny ``LlamaConfig`` / ``Qwen3Config`` (d = 32, 4 heads, 2 KV heads by default).

    ``head_dim`` None keeps the architecture's default (Llama: d / heads; Qwen3: 128); ``attn``
    sets the attention implementation ("sdpa", "eager"); ``extra`` goes to the config as is
    (e.g. ``bos_token_id=None``).
    """
    from transformers import LlamaConfig, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, max_position_embeddings=max_positions,
                  initializer_range=init_range, tie_word_embeddings=tied, **extra)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    config = classes[arch](**kwargs)
    if attn is not None:
        config._attn_implementation = attn
    return config


def tiny_causal_lm(arch: str = "llama", *, seed: int = 0, keep_eos: bool = False, **config):
    """A tiny randomly initialised HF causal LM in eval mode, weights drawn after
    ``torch.manual_seed(seed)``; ``config`` as :func:`tiny_config`.

    Without ``keep_eos`` its generation config has no EOS, so greedy decodes run to
    max_new_tokens.
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if not keep_eos:
        model.generation_config.eos_token_id = None
    return model


def save_tiny_target(path: Path, model) -> Path:
    """Write ``model`` and a word-level tokenizer (token ``t{i}`` is id i, unknown words are t0)
    to the folder ``path``: an HF model folder ``dspark.targets.load_target`` accepts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = model.config.vocab_size
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------
# χ² goodness of fit
# --------------------------------------------------------------------------------------------


def sequence_counts(tokens: torch.Tensor, V: int) -> np.ndarray:
    """Counts [V**n] of sampled sequences tokens [N, n] (ids < V), category = the sequence read
    as a base-V number (x_1·V^{n-1} + … + x_n, the flat index of the joint law [V, …, V])."""
    n = tokens.shape[1]
    code = torch.zeros(tokens.shape[0], dtype=torch.long)
    for i in range(n):
        code = code * V + tokens[:, i]
    return np.bincount(code.numpy(), minlength=V**n)


def chi2_pvalue(counts, probs, *, min_expected: float = 5.0, exact_support: bool = True) -> float:
    """Pearson χ² p-value of observed category counts [K] against exact probabilities [K].

    Categories expected fewer than ``min_expected`` times are pooled into one; if that pool is
    itself still below ``min_expected`` it is merged into the smallest regular category. With
    ``exact_support`` a count in a category of probability 0 is an impossible outcome and gives
    p = 0. Pass ``exact_support=False`` when ``probs`` come from another forward than the
    sampler's (float noise can move a token across a top-k / top-p boundary): such counts are
    then pooled with the rare categories. Fewer than two categories left: p = 1.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if counts.shape != probs.shape or counts.ndim != 1:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} must be equal 1-D shapes")
    if exact_support and counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = expected < min_expected
    obs, exp = counts[~small], expected[~small]
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp == 0.0:
            if pooled_obs > 0:
                return 0.0  # outcomes the target can never produce were sampled
        elif pooled_exp < min_expected and exp.size:
            i = int(np.argmin(exp))
            obs, exp = obs.copy(), exp.copy()
            obs[i] += pooled_obs
            exp[i] += pooled_exp
        else:
            obs, exp = np.append(obs, pooled_obs), np.append(exp, pooled_exp)
    if exp.size < 2:
        return 1.0
    exp = exp * obs.sum() / exp.sum()  # float rounding only; scipy wants equal totals
    return float(stats.chisquare(obs, exp).pvalue)


def assert_same_distribution(counts, probs, label: str = "", *, alpha: float = 1e-3, **kwargs) -> float:
    """Assert the χ² test (:func:`chi2_pvalue`, same keywords) does not reject at level ``alpha``;
    returns the p-value."""
    pvalue = chi2_pvalue(counts, probs, **kwargs)
    assert pvalue > alpha, f"{label}: χ² p = {pvalue:.2e} (threshold {alpha:g})"
    return pvalue


# --------------------------------------------------------------------------------------------
# Engine drivers and oracles
# --------------------------------------------------------------------------------------------


def greedy_decode(model, prompt: torch.Tensor, n: int) -> list[int]:
    """The HF model's own greedy continuation of ``prompt`` [n_prompt]: n new token ids."""
    out = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, prompt.numel():].tolist()


def exact_two_token_probs(model, prompt: torch.Tensor, params) -> np.ndarray:
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


class TickClock:
    """A deterministic clock for ``Engine(clock=...)``: every reading advances it by ``tick``
    seconds, so timings (and the draft gate's decisions, which read them) do not depend on the
    machine's speed or load."""

    def __init__(self, tick: float = 1e-3) -> None:
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def race_eager_runner_only(monkeypatch, raced: list | None = None, overhead=None) -> None:
    """Have ``dspark.fast.drafter``'s runner race time the eager runner alone, over 2 rounds (quick:
    the compiled and onnxruntime runners are tests/test_fast_drafter.py's). ``raced`` collects the
    path of each target raced on; ``overhead(drafter, seconds)`` replaces the timed overhead."""
    import attrs

    import dspark.fast.drafter as fd

    real = fd.choose_draft_runner

    def race(target, drafter, ids, cost, calibrator=None, **_):
        if raced is not None:
            raced.append(target.path)
        choice = real(target, drafter, ids, cost, calibrator, candidates=("eager",), rounds=2)
        if overhead is not None:
            choice = attrs.evolve(choice, overhead_seconds={"eager": overhead(drafter, choice.overhead_seconds["eager"])})
        return choice

    monkeypatch.setattr(fd, "choose_draft_runner", race)
