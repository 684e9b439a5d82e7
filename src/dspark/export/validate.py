"""Parity between a PyTorch drafter and the same drafter run from its exported graphs.

:func:`compare_drafters` feeds both the same three rounds — requests of different lengths (one of
them a one-token prompt), a second round after some drafts were "accepted" (incremental
context), then a sampled round with identically seeded per-request generators — and reports the
largest differences. ``python -m dspark.export --validate`` and the tests use it.

The target features matter. With ``target`` (an :class:`~dspark.targets.HFTarget`, or anything
with ``set_capture_layers`` / ``prefill`` / ``release``) the prompts are a few natural prompts of
the shipped evaluation set (``dspark/data/natural_eval.jsonl``, chat-templated when the target's
tokenizer has a template; random token ids without a tokenizer) and the features are the
target's own hidden states at the drafter's ``target_layer_ids``, captured the way the engine
captures them (one prefill, then a ``verify`` of the committed tokens each round). Real features are large: SmolLM2-135M's reach |x| ≈ 2.5e4 in a few channels
("massive activations"), where x² overflows fp16 (max 65504) unless RMSNorm squares in fp32.
Without a target the features are randn with a few such outlier channels
(:data:`OUTLIER_MAGNITUDE`), never plain randn (|x| < 6), which no fp16 engine would fail on.

fp32 parity runs with TF32 off (:func:`no_tf32`): TF32 matmuls round inputs to 10-bit mantissas,
enough to flip a near-tied greedy draft on a CUDA reference drafter.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from dspark.drafters.vocab import NEG
from dspark.protocols.drafter import DraftContext, TargetFeatures
from dspark.types import SamplingParams

__all__ = ["ParityReport", "compare_drafters", "no_tf32", "natural_prompts", "capture_features",
           "outlier_features", "OUTLIER_MAGNITUDE"]

# |x| of the outlier channels of the synthetic features: SmolLM2-135M's captured hidden states
# reach about this (measured on its real prompts); fp16's x² overflows above |x| = 256.
OUTLIER_MAGNITUDE = 2.5e4


@attrs.frozen
class ParityReport:
    max_abs_logits: float  # draft (head-corrected) logits, all rounds
    logit_scale: float  # max |logit| of the reference, for a relative reading
    max_abs_confidence: float | None
    max_abs_hidden: float | None
    greedy_tokens_equal: bool
    sampled_tokens_equal: bool
    rounds: int
    requests: int
    features: str = "randn"  # "target" (captured from the target) or "randn" (synthetic, with outliers)
    max_abs_feature: float = 0.0  # the largest |feature| fed to the drafters
    exported_finite: bool = True  # every exported logit finite (an fp16 overflow shows here first)

    def passed(self, atol: float) -> bool:
        return (self.exported_finite and self.max_abs_logits <= atol and self.greedy_tokens_equal
                and (self.max_abs_confidence is None or self.max_abs_confidence <= atol))

    def summary(self) -> str:
        conf = "" if self.max_abs_confidence is None else f", confidence {self.max_abs_confidence:.2e}"
        finite = "" if self.exported_finite else "; NON-FINITE exported logits (fp16 overflow?)"
        src = "target features" if self.features == "target" else "synthetic features"
        return (f"max |Δ logits| {self.max_abs_logits:.2e} (logits up to {self.logit_scale:.1f}){conf}; "
                f"greedy drafts {'identical' if self.greedy_tokens_equal else 'DIFFER'}, sampled drafts "
                f"{'identical' if self.sampled_tokens_equal else 'differ'} "
                f"({self.requests} requests × {self.rounds} rounds, {src} up to |x| "
                f"{self.max_abs_feature:.3g}){finite}")


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """TF32 off for CUDA matmuls and cuDNN inside the block; the previous settings come back after."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def _maxdiff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    return float((a.float().cpu() - b.float().cpu()).abs().max())


_FALLBACK_PROMPTS = (
    "$3000 is invested at 5% a year, compounded annually. What is it worth after 5 years?",
    "What is the time complexity of binary search, and why?",
    "Turn this into three short bullet points: buffered streams read ahead so small reads are cheap.",
)


def natural_prompts(n: int = 3) -> list[str]:
    """The first prompt of each domain of the shipped evaluation set (math, code, chat), n in all."""
    from importlib import resources

    try:
        text = (resources.files("dspark.data") / "natural_eval.jsonl").read_text(encoding="utf-8")
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError, ModuleNotFoundError):
        return list(_FALLBACK_PROMPTS[:n])
    firsts, seen = [], set()
    for row in rows:
        if row.get("domain") not in seen and row.get("prompt"):
            seen.add(row.get("domain"))
            firsts.append(row["prompt"])
    rest = [r["prompt"] for r in rows if r.get("prompt") and r["prompt"] not in firsts]
    return (firsts + rest)[:n] or list(_FALLBACK_PROMPTS[:n])


def _can_capture(target: Any) -> bool:
    return all(callable(getattr(target, m, None)) for m in ("set_capture_layers", "prefill", "verify", "release"))


def capture_features(target: Any, tokens: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> list[torch.Tensor]:
    """The target's features of every token before the last (the anchor), per sequence: [n − 1, m·d]
    fp32 CPU, layers concatenated in ``layer_ids`` order (as the engine feeds drafters). The
    target's capture layers are restored afterwards; no request is left registered."""
    before = tuple(getattr(target, "capture_layers", ()))
    target.set_capture_layers(tuple(layer_ids))
    out = []
    try:
        for i, seq in enumerate(tokens):
            rid = f"dspark-export-validate-{i}"
            res = target.prefill([rid], [seq], logits=False)
            try:
                n = int(res.lengths[0])
                hs = res.hidden_states
                out.append(torch.cat([hs[k][0, :n] for k in layer_ids], dim=-1).float().cpu())
            finally:
                target.release(rid)
    finally:
        target.set_capture_layers(before)
    return out


class _TargetFeatures:
    """The target's features round by round, the way the engine gets them: one batched prefill of
    the prompts, then per round one ``verify`` of [previous anchor, committed drafts] — its K/V
    cache grows like a real request's, so nothing is recomputed."""

    def __init__(self, target: Any, layer_ids: Sequence[int], rids: Sequence[str]) -> None:
        self.target, self.layer_ids = target, tuple(layer_ids)
        self.rids = [f"dspark-export-validate-{r}" for r in rids]
        self.before = tuple(getattr(target, "capture_layers", ()))
        self.started = False

    def _rows(self, out: Any, counts: Sequence[int]) -> list[torch.Tensor]:
        hs = out.hidden_states
        return [torch.cat([hs[k][i, :n] for k in self.layer_ids], dim=-1).float().cpu()
                for i, n in enumerate(counts)]

    def first(self, tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.target.set_capture_layers(self.layer_ids)
        self.started = True
        out = self.target.prefill(self.rids, list(tokens), logits=False)
        return self._rows(out, [int(n) for n in out.lengths])

    def extend(self, anchors: Sequence[int], drafts: Sequence[torch.Tensor], gamma: int) -> list[torch.Tensor]:
        """Commit [anchor, drafts] of each request (the new anchor follows); their features."""
        rows = torch.zeros(len(anchors), gamma + 1, dtype=torch.long)
        for i, (a, d) in enumerate(zip(anchors, drafts)):
            rows[i, 0] = a
            rows[i, 1: 1 + d.numel()] = d
        lengths = torch.tensor([d.numel() for d in drafts])
        out = self.target.verify(self.rids, rows, lengths)
        return self._rows(out, (lengths + 1).tolist())

    def close(self) -> None:
        if self.started:
            for rid in self.rids:
                with contextlib.suppress(Exception):
                    self.target.release(rid)
            self.target.set_capture_layers(self.before)


def outlier_features(n: int, width: int, generator: torch.Generator, blocks: int = 1,
                     magnitude: float = OUTLIER_MAGNITUDE) -> torch.Tensor:
    """randn [n, width] with one outlier channel per feature block (±``magnitude``, as real target
    hidden states have): enough to overflow an fp16 x² anywhere it is not computed in fp32."""
    x = torch.randn(n, width, generator=generator)
    step = max(1, width // max(1, blocks))
    for b in range(max(1, blocks)):
        ch = min(width - 1, b * step + (7 * b + 3) % step)
        x[:, ch] = magnitude * torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    return x


def _prompt_tokens(target: Any, V: int, max_tokens: int, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n natural prompts encoded with the target's tokenizer (truncated to ``max_tokens``), or random
    ids without one; plus a one-token prompt (the empty-context edge case)."""
    tok = getattr(target, "tokenizer", None)
    seqs: list[torch.Tensor] = []
    if tok is not None:
        from dspark.engine import encode_prompt

        for text in natural_prompts(n):
            try:
                ids = encode_prompt(tok, text)[:max_tokens]
            except Exception:  # a tokenizer that cannot encode text: random ids below
                seqs = []
                break
            if ids.numel() < 2 or int(ids.max()) >= V:
                seqs = []
                break
            seqs.append(ids.long())
    if not seqs:
        seqs = [torch.randint(0, V, (k,), generator=gen) for k in (6, 13, 21)[:n]]
    return [seqs[0][:1].clone(), *seqs]


@torch.inference_mode()
def compare_drafters(
    reference: Any,
    exported: Any,
    *,
    target: Any = None,
    prompt_lengths: Sequence[int] = (1, 6, 13),
    seed: int = 0,
    max_prompt_tokens: int = 96,
    outlier_magnitude: float = OUTLIER_MAGNITUDE,
    allow_tf32: bool = False,
) -> ParityReport:
    """Run ``reference`` (PyTorch) and ``exported`` on the same three rounds; compare.

    ``target``: capture real features from it (natural prompts, see the module docstring; it
    needs ``set_capture_layers`` / ``prefill`` / ``verify`` / ``release``, as HFTarget has);
    without one, ``prompt_lengths`` random prompts with synthetic features (randn + outlier
    channels of ``outlier_magnitude``; 0 gives plain randn). ``allow_tf32``: leave torch's TF32
    settings alone (default: off for the duration, restored afterwards).
    """
    with contextlib.nullcontext() if allow_tf32 else no_tf32():
        return _compare(reference, exported, target, prompt_lengths, seed, max_prompt_tokens, outlier_magnitude)


def _compare(reference: Any, exported: Any, target: Any, prompt_lengths: Sequence[int], seed: int,
             max_prompt_tokens: int, outlier_magnitude: float) -> ParityReport:
    gen = torch.Generator().manual_seed(seed)
    V = reference.vocab_size
    layer_ids = tuple(reference.target_layer_ids)
    F_in = len(layer_ids) * reference.config.layer.hidden_size
    real = target is not None and _can_capture(target)
    if real:
        room = getattr(target, "max_context", None)  # the prompts grow by ≤ γ + 1 a round
        cap = max_prompt_tokens if room is None else min(max_prompt_tokens, int(room) - 3 * (reference.gamma + 2))
        tokens = _prompt_tokens(target, V, max(2, cap), 3, gen)
    else:
        tokens = [torch.randint(0, V, (n,), generator=gen) for n in prompt_lengths]
    rids = [f"parity-{seed}-{i}" for i in range(len(tokens))]
    source = _TargetFeatures(target, layer_ids, rids) if real else None
    seen = [0] * len(tokens)
    diffs = {"logits": 0.0, "conf": None, "hidden": None}
    scale, greedy_eq, sampled_eq, finite, fmax = 0.0, True, True, True, 0.0
    schedule = ["greedy", "greedy", "sampled"]
    anchors: list[int] = []
    committed: list[torch.Tensor] = []
    try:
        for rnd, mode in enumerate(schedule):
            if real:
                feats = source.first(tokens) if rnd == 0 else source.extend(anchors, committed, reference.gamma)
            else:
                feats = [outlier_features(t.numel() - 1 - s, F_in, gen, len(layer_ids), outlier_magnitude)
                         if outlier_magnitude else torch.randn(t.numel() - 1 - s, F_in, generator=gen)
                         for t, s in zip(tokens, seen)]
            fmax = max([fmax, *(float(f.abs().max()) for f in feats if f.numel())])
            seen = [t.numel() - 1 for t in tokens]
            if mode == "greedy":
                sampling, gens_a, gens_b = [SamplingParams()] * len(tokens), None, None
            else:
                sampling = [SamplingParams(temperature=1.0)] * len(tokens)
                gens_a = [torch.Generator().manual_seed(100 + i) for i in range(len(tokens))]
                gens_b = [torch.Generator().manual_seed(100 + i) for i in range(len(tokens))]
            a = reference.draft(DraftContext(rids, tokens, sampling, gens_a, features=TargetFeatures(feats)))
            b = exported.draft(DraftContext(rids, tokens, sampling, gens_b, features=TargetFeatures(feats)))
            finite &= bool(torch.isfinite(b.draft_logits.float()).all())
            diffs["logits"] = max(diffs["logits"], _maxdiff(a.draft_logits, b.draft_logits))
            kept = a.draft_logits[a.draft_logits > NEG / 2]  # not the "outside the draft vocabulary" fill
            scale = max(scale, float(kept.abs().max()))
            for key, x, y in (("conf", a.confidence_logits, b.confidence_logits), ("hidden", a.hidden, b.hidden)):
                d = _maxdiff(x, y)
                if d is not None:
                    diffs[key] = max(diffs[key] or 0.0, d)
            same = bool(torch.equal(a.tokens.cpu(), b.tokens.cpu()))
            if mode == "greedy":
                greedy_eq &= same
            else:
                sampled_eq &= same
            # Commit a few of the reference's drafts plus one "recovered" token, varying per request.
            anchors = [int(t[-1]) for t in tokens]
            committed = [a.tokens[i, : (i + rnd) % (a.gamma + 1)].cpu() for i in range(len(tokens))]
            tokens = [torch.cat([t, c, torch.randint(0, V, (1,), generator=gen)]) for t, c in zip(tokens, committed)]
    finally:
        for rid in rids:
            reference.release(rid)
            exported.release(rid)
        if source is not None:
            source.close()
    return ParityReport(
        max_abs_logits=diffs["logits"], logit_scale=scale, max_abs_confidence=diffs["conf"],
        max_abs_hidden=diffs["hidden"], greedy_tokens_equal=greedy_eq, sampled_tokens_equal=sampled_eq,
        rounds=len(schedule), requests=len(tokens), features="target" if real else "randn",
        max_abs_feature=fmax, exported_finite=finite,
    )
