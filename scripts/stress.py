"""Serving stress test (issue 14, "Under load"): many concurrent greedy requests through one Engine.

    python scripts/stress.py --requests 256 --concurrency 64 --max-new-tokens 24 --target smollm2

One ``Engine`` (``sps-greedy`` with the draft gate, as ``dspark demo`` / ``dspark bench`` run it)
serves ``--requests`` submissions, at most ``--concurrency`` unfinished at a time: the Engine has no
batch cap of its own, so the driver admits queued requests as others finish (and at most
``concurrency / 4`` per round, so the first wave too joins while earlier requests are mid-decode).
Prompts and budgets are mixed (held-out chat prompts, half of them cut to a random prefix; 1 to
``--max-new-tokens`` new tokens), drawn from ``random.Random(--seed)``. About 10 % of the requests
are aborted 1–3 rounds after they join, two of them in the round they finish (abort then changes
nothing), and one submission is bad (an over-long or an empty prompt) and must be refused with a
clear ``ValueError`` without touching the requests being served.

Checked (the same properties ``tests/test_stress.py`` asserts on the tiny target):

* none lost, none twice: every accepted request is collected exactly once;
* every finished output equals the target's own plain greedy decode of its prompt (HF
  ``generate(do_sample=False)``, run batched with left padding; any disagreement is decided by an
  unbatched decode); an aborted request's tokens are a prefix of that decode and nothing is
  streamed for it after the abort; in bfloat16, where identity is not exact (docs/serving-and-benchmarks.md,
  "Greedy identity is an fp32 property"), each divergence must sit on a near-tie of the top-2
  logits (gap ≤ 0.25, as ``tests/test_real_target_engine.py``);
* memory bounded: after every round the target's KV caches and the drafter's caches belong to
  exactly the unfinished requests, an aborted request's caches are freed at once, and nothing is
  held after the run; resident memory is sampled every round (``/proc/self/status`` VmRSS) next to
  the peak (``getrusage`` ru_maxrss).

Writes a JSON report to ``--out`` (default ``runs/stress.json``) and exits 1 if a check failed.
``tests/test_stress.py`` imports this file for :func:`make_jobs`, :func:`drive`,
:func:`reference_decode` and :func:`held_request_ids`.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import resource
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import define, field

NEAR_TIE = 0.25  # logit gap below which a bf16 divergence counts as a near-tie


# --------------------------------------------------------------------------------------------
# The scenario
# --------------------------------------------------------------------------------------------


@define
class Job:
    """One submission: a prompt, its budget, when to abort it (rounds after it joined), or
    ``bad`` ("long" / "empty"): a request the engine must refuse."""

    index: int
    prompt: torch.Tensor
    max_new_tokens: int
    abort_after: int | None = None
    bad: str | None = None

    @property
    def request_id(self) -> str:
        return f"{'bad' if self.bad else 'r'}{self.index:03d}"


def make_jobs(pool: Sequence[torch.Tensor], n: int, max_new_tokens: int, *, max_context: int,
              seed: int = 0, abort_fraction: float = 0.1, bad: str = "long") -> list[Job]:
    """``n`` submissions from the prompt ``pool``, deterministic in ``seed``.

    Half the prompts are cut to a random prefix (mixed lengths); budgets are uniform in
    1..max_new_tokens. round(abort_fraction · n) requests are aborted: all but two get the full
    budget and are aborted 1–3 rounds after joining (mid-decode); two get a budget of 1 and are
    aborted after their first round, the one that finishes them (the abort must change nothing).
    One submission, in the middle half, is ``bad``: a prompt of max_context + 4 tokens ("long")
    or no token at all ("empty").
    """
    if bad not in ("long", "empty"):
        raise ValueError(f"bad must be 'long' or 'empty', got {bad!r}")
    rng = random.Random(seed)
    bad_at = rng.randrange(n // 4, 3 * n // 4)
    aborted = sorted(rng.sample([i for i in range(n) if i != bad_at], round(abort_fraction * n)))
    late = set(aborted[:2])
    jobs = []
    for i in range(n):
        if i == bad_at:
            prompt = (torch.arange(max_context + 4) % 7 if bad == "long" else torch.empty(0)).long()
            jobs.append(Job(i, prompt, max_new_tokens, bad=bad))
            continue
        base = pool[rng.randrange(len(pool))]
        prompt = base[: rng.randint(1, base.numel())].clone() if rng.random() < 0.5 else base.clone()
        budget, abort_after = rng.randint(1, max_new_tokens), None
        if i in late:
            budget, abort_after = 1, 1
        elif i in aborted:
            budget, abort_after = max_new_tokens, rng.randint(1, 3)
        jobs.append(Job(i, prompt, budget, abort_after))
    return jobs


def held_request_ids(engine: Any) -> dict[str, set[str]]:
    """The request ids each part of ``engine`` holds state for: the engine's table, the
    target's KV caches, the drafter's context caches (and Eagle3's pending features)."""
    held = {"engine": set(engine.active), "target": set(engine.target.request_ids), "drafter": set()}
    d = engine.drafter
    if d is not None:
        loop = getattr(d, "_loop", None) if hasattr(d, "_loop") else getattr(d, "loop", None)
        if loop is not None:
            held["drafter"] = set(getattr(loop, "caches", {})) | set(getattr(loop, "pending", {}))
    return held


def held_bytes(engine: Any) -> dict[str, int]:
    """Bytes of per-request KV state and reused scratch buffers (diagnostic; reads internals)."""
    t = engine.target
    out = {"target_kv": sum(r.kv.numel() * r.kv.element_size() for r in getattr(t, "_requests", {}).values()),
           "target_scratch": getattr(t, "_scratch", torch.empty(0)).nbytes, "drafter_kv": 0, "drafter_scratch": 0}
    loop = getattr(engine.drafter, "_loop", None)
    if loop is not None:
        out["drafter_kv"] = sum(c.k.nbytes + c.v.nbytes for c in loop.caches.values() if c.k is not None)
        out["drafter_scratch"] = sum(b.nbytes for b in getattr(loop, "_scratch", []))
    return out


@define
class StressRun:
    """What :func:`drive` saw. Request ids are the jobs' (``Job.request_id``)."""

    jobs: list[Job]
    concurrency: int
    admitted: list[str] = field(factory=list)
    rejected: dict[int, tuple[str, str]] = field(factory=dict)  # job index → (error type, message)
    accepted_bad: list[int] = field(factory=list)  # bad jobs the engine took (a failure)
    bad_disturbed: list[str] = field(factory=list)  # what a refusal changed (a failure)
    aborted_running: dict[str, int] = field(factory=dict)  # rid → tokens it had when aborted
    abort_noop: dict[str, str] = field(factory=dict)  # rid → reason it had finished with
    not_released_on_abort: list[str] = field(factory=list)
    streamed: dict[str, list[int]] = field(factory=dict)
    after_end: dict[str, int] = field(factory=dict)  # tokens streamed after finish / abort
    completions: dict[str, Any] = field(factory=dict)
    duplicates: list[str] = field(factory=list)
    unknown: list[str] = field(factory=list)  # collected ids never admitted
    leaks: list[str] = field(factory=list)  # rounds where held state ≠ the unfinished requests
    held_after: dict[str, list[str]] = field(factory=dict)
    max_active: int = 0  # most requests in one round
    joins_mid_decode: int = 0  # admissions while another request had already run ≥ 1 round
    steps: int = 0
    seconds: float = 0.0
    drafted_rounds: int = 0
    skipped_rounds: int = 0  # rounds with a drafter that the draft gate ran plain
    verified_drafts: int = 0
    accepted_drafts: int = 0

    @property
    def job_of(self) -> dict[str, Job]:
        return {j.request_id: j for j in self.jobs}


def drive(engine: Any, jobs: Sequence[Job], concurrency: int, *, join_burst: int | None = None,
          progress: Any = None, on_step: Callable[[Any, StressRun], None] | None = None) -> StressRun:
    """Serve ``jobs`` in order through ``engine`` (greedy), at most ``concurrency`` unfinished.

    Each loop: admit queued jobs while fewer than ``concurrency`` are unfinished (at most
    ``join_burst`` per round, default concurrency / 4); one ``step()``; abort the jobs whose
    ``abort_after`` rounds are up; ``pop_finished()``; check that the target and drafter hold
    state for exactly the unfinished requests. Records everything in a :class:`StressRun`; only
    an engine that stops making progress raises.
    """
    from dspark.types import SamplingParams

    greedy = SamplingParams.greedy()
    join_burst = join_burst or max(1, concurrency // 4)
    run = StressRun(list(jobs), concurrency)
    job_of = run.job_of
    queue = deque(jobs)
    joined_at: dict[str, int] = {}
    ended: dict[str, str] = {}  # rid → finish reason seen in the stream, or "abort"
    limit = sum(j.max_new_tokens for j in jobs) + len(jobs) + 1  # each round commits ≥ 1 token per request
    t0 = time.perf_counter()
    while queue or engine.active:
        joined = 0
        while queue and len(engine.active) < concurrency and joined < join_burst:
            job = queue.popleft()
            rid = job.request_id
            if job.bad is not None:
                before = held_request_ids(engine)
                try:
                    engine.add_request(job.prompt, greedy, max_new_tokens=job.max_new_tokens, request_id=rid)
                except Exception as err:  # recorded; the checks decide whether it was the right error
                    run.rejected[job.index] = (type(err).__name__, str(err))
                    after = held_request_ids(engine)
                    if after != before:
                        run.bad_disturbed.append(f"refusing {rid} changed the held state: {before} → {after}")
                    continue
                run.accepted_bad.append(job.index)
            else:
                engine.add_request(job.prompt, greedy, max_new_tokens=job.max_new_tokens, request_id=rid)
            if any(run.steps > joined_at[r] for r in joined_at if r not in ended):
                run.joins_mid_decode += 1
            joined_at[rid] = run.steps
            run.admitted.append(rid)
            run.streamed[rid] = []
            joined += 1
        if not engine.active:
            continue
        run.max_active = max(run.max_active, len(engine.active))
        outputs = engine.step()
        run.steps += 1
        if run.steps > limit:
            raise RuntimeError(f"no progress: {run.steps} rounds, more than the jobs' budgets allow")
        info = engine.last_round
        if info is not None:
            run.drafted_rounds += bool(info.drafted)
            run.skipped_rounds += bool(engine.drafter is not None and not info.drafted)
            run.verified_drafts += sum(info.lengths)
            run.accepted_drafts += sum(info.accepted)
        for o in outputs:
            if o.request_id in ended:
                run.after_end[o.request_id] = run.after_end.get(o.request_id, 0) + len(o.new_tokens)
                continue
            run.streamed[o.request_id].extend(o.new_tokens)
            if o.finished:
                ended[o.request_id] = o.finished
        # every request the engine still holds: running, or finished this round and not yet
        # collected (aborting one of those must change nothing)
        for rid in [r for r in joined_at if r not in run.completions]:
            job = job_of[rid]
            if job.abort_after is None or run.steps - joined_at[rid] != job.abort_after:
                continue
            engine.abort(rid)
            if rid in ended:
                run.abort_noop[rid] = ended[rid]
            else:
                ended[rid] = "abort"
                run.aborted_running[rid] = len(run.streamed[rid])
                held = held_request_ids(engine)
                if rid in held["target"] or rid in held["drafter"]:
                    run.not_released_on_abort.append(rid)
        for c in engine.pop_finished():
            if c.request_id in run.completions:
                run.duplicates.append(c.request_id)
            elif c.request_id not in joined_at:
                run.unknown.append(c.request_id)
            else:
                run.completions[c.request_id] = c
                if progress is not None:
                    progress.update(1)
        live = {r for r in joined_at if r not in ended}
        held = held_request_ids(engine)
        if held["engine"] != live or held["target"] != live or not held["drafter"] <= live:
            run.leaks.append(f"round {run.steps}: unfinished {len(live)}, engine {sorted(held['engine'] ^ live)}, "
                             f"target {sorted(held['target'] ^ live)}, drafter {sorted(held['drafter'] - live)}")
        if on_step is not None:
            on_step(engine, run)
    run.seconds = time.perf_counter() - t0
    run.held_after = {k: sorted(v) for k, v in held_request_ids(engine).items()}
    return run


# --------------------------------------------------------------------------------------------
# The reference: the target's own greedy decode
# --------------------------------------------------------------------------------------------


def _cut(tokens: list[int], budget: int, eos: int | None) -> list[int]:
    tokens = tokens[:budget]
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


@torch.inference_mode()
def greedy_one(model: Any, prompt: torch.Tensor, n: int, eos: int | None) -> list[int]:
    """The HF model's greedy decode of one prompt, unbatched (``dspark.speculative.plain_generate``
    with a pad id for models without EOS)."""
    out = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos if eos is not None else 0)
    return _cut(out[0, prompt.numel():].tolist(), n, eos)


@torch.inference_mode()
def reference_decode(model: Any, prompts: Sequence[torch.Tensor], budgets: Sequence[int], eos: int | None, *,
                     batch_size: int = 32, progress: Any = None) -> list[list[int]]:
    """Greedy decodes of ``prompts`` (HF ``generate(do_sample=False)``), batched: sorted by
    length, left-padded, each batch run to its largest budget and every row cut to its own
    budget and at EOS (kept), as the engine cuts."""
    pad = eos if eos is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i].numel(), i))
    out: list[list[int]] = [[] for _ in prompts]
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        L = max(prompts[i].numel() for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        mask = torch.zeros(len(idx), L, dtype=torch.long)
        for r, i in enumerate(idx):
            n = prompts[i].numel()
            ids[r, L - n :] = prompts[i]
            mask[r, L - n :] = 1
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=max(budgets[i] for i in idx),
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for r, i in enumerate(idx):
            out[i] = _cut(gen[r, L:].tolist(), budgets[i], eos)
        if progress is not None:
            progress.update(len(idx))
    return out


def _divergence(got: list[int], ref: list[int], prefix: bool) -> int | None:
    """First index where ``got`` leaves ``ref`` (None: equal, or with ``prefix`` a prefix of it)."""
    k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if k is not None:
        return k
    if len(got) == len(ref) or (prefix and len(got) <= len(ref)):
        return None
    return min(len(got), len(ref))


@torch.inference_mode()
def _logit_gap(model: Any, prompt: torch.Tensor, ref: list[int], got: list[int], k: int) -> float | None:
    if k >= len(ref) or k >= len(got):
        return None  # one stopped where the other went on: not a choice between two tokens
    logits = model(torch.cat([prompt, torch.tensor(ref[:k], dtype=torch.long)])[None]).logits[0, -1].float()
    return abs(float(logits[ref[k]] - logits[got[k]]))


def check(run: StressRun, model: Any, eos: int | None, *, exact: bool = True, batch_size: int = 32,
          progress: Any = None) -> dict[str, Any]:
    """The report's checks (see the module docstring); ``exact`` False (bf16) accepts
    divergences on near-ties. ``ok`` is every check together."""
    jobs = run.job_of
    good = [j for j in run.jobs if j.bad is None]
    bad = [j for j in run.jobs if j.bad is not None]
    collected = set(run.completions)
    lost = sorted(j.request_id for j in good if j.request_id not in collected)
    refs = reference_decode(model, [j.prompt for j in good], [j.max_new_tokens for j in good], eos,
                            batch_size=batch_size, progress=progress)
    ref_of = {j.request_id: r for j, r in zip(good, refs)}
    identical, near_ties, wrong, batched_disagreed = 0, [], [], 0
    aborted_ok, reasons = 0, {}
    for rid, c in sorted(run.completions.items()):
        if rid not in ref_of:
            continue
        job, aborted = jobs[rid], c.finish_reason == "abort"
        reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
        if c.output_ids != run.streamed.get(rid):
            wrong.append({"request": rid, "problem": "completion differs from the streamed tokens"})
            continue
        ref = ref_of[rid]
        if _divergence(c.output_ids, ref, aborted) is not None:  # decide with an unbatched decode
            batched_disagreed += 1
            ref = ref_of[rid] = greedy_one(model, job.prompt, job.max_new_tokens, eos)
        k = _divergence(c.output_ids, ref, aborted)
        if k is None:
            identical += 1
            aborted_ok += aborted and len(c.output_ids) < job.max_new_tokens
            continue
        gap = _logit_gap(model, job.prompt, ref, c.output_ids, k)
        row = {"request": rid, "at": k, "prompt_tokens": job.prompt.numel(), "logit_gap": gap,
               "got": c.output_ids[k : k + 4], "reference": ref[k : k + 4]}
        (near_ties if not exact and gap is not None and gap <= NEAR_TIE else wrong).append(row)
    expected_aborts = sorted(r for r in run.aborted_running)
    bad_ok = [j.index for j in bad if j.index in run.rejected and run.rejected[j.index][0] == "ValueError"
              and ("context window" if j.bad == "long" else "prompt is empty") in run.rejected[j.index][1]]
    abort_wrong = sorted(r for r in expected_aborts if r in run.completions
                         and run.completions[r].finish_reason != "abort")
    abort_noop_wrong = sorted(r for r, why in run.abort_noop.items()
                              if r in run.completions and run.completions[r].finish_reason != why)
    result = {
        "submitted": len(run.jobs), "valid": len(good), "bad": len(bad), "admitted": len(run.admitted),
        "collected": len(collected), "lost": lost, "duplicates": run.duplicates, "unknown": run.unknown,
        "finish_reasons": reasons,
        "aborted_mid_decode": len(run.aborted_running), "abort_after_finish_noop": len(run.abort_noop),
        "aborts_reported_as_abort": len(expected_aborts) - len(abort_wrong),
        "aborted_outputs_prefix_of_greedy": aborted_ok,
        "aborts_not_released_at_once": run.not_released_on_abort, "tokens_streamed_after_end": run.after_end,
        "abort_noop_changed_reason": abort_noop_wrong,
        "bad_requests": [{"kind": j.bad, "index": j.index, "error": run.rejected.get(j.index)} for j in bad],
        "bad_rejected_clearly": len(bad_ok), "bad_accepted": run.accepted_bad, "bad_disturbed": run.bad_disturbed,
        "identical_to_greedy": identical, "near_tie_divergences": near_ties, "wrong": wrong,
        "batched_reference_disagreed": batched_disagreed,
        "leaks": run.leaks[:10], "leak_rounds": len(run.leaks), "held_after": run.held_after,
    }
    result["ok"] = bool(
        not lost and not run.duplicates and not run.unknown and not wrong and not abort_wrong
        and not abort_noop_wrong and not run.not_released_on_abort and not run.after_end
        and len(bad_ok) == len(bad) and not run.accepted_bad and not run.bad_disturbed and not run.leaks
        and not any(run.held_after.values()) and run.max_active <= run.concurrency
        and identical + len(near_ties) == len(collected))
    return result


# --------------------------------------------------------------------------------------------
# Targets, drafters and memory
# --------------------------------------------------------------------------------------------


def flat_cost_model() -> Any:
    """A flat packed profile: drafting always pays, so sps-greedy verifies drafts at any batch
    size (the tiny target's step time means nothing; tests/test_engine.py's FLAT)."""
    import dspark

    return dspark.get_cost_model("sps-table", profile={
        "device": "test", "model": "tiny", "dtype": "float32", "date": "2026-11-30", "accounting": "packed",
        "points": [{"batch_size": 1, "step_seconds": 1e-4}, {"batch_size": 65536, "step_seconds": 1.01e-4}]})


def tiny_model(vocab_size: int = 16, max_positions: int = 96, seed: int = 0) -> Any:
    """A tiny random Llama (d = 32, 4 layers, no EOS), as tests/helpers.py's tiny_causal_lm."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
                      initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def tiny_drafter(target: Any, seed: int = 1) -> Any:
    """A random DSpark drafter (gated-markov head, rank 8, 2 layers, γ = 4), weights ~ N(0, 0.2²)
    so that drafts are accepted often on a 16-token vocabulary (tests/test_engine.py's recipe)."""
    import dspark

    torch.manual_seed(seed)
    d = dspark.get_drafter("dspark", target=target, gamma=4, head="gated-markov", rank=8, num_layers=2)
    for p in d.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.2)
    return d


def vm_rss_kb() -> int | None:
    """Resident set size now (VmRSS, kB), or None where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_kb() -> int:
    """Peak resident set size of this process so far (ru_maxrss: kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def _setup(args: argparse.Namespace) -> tuple[Any, Any, list[torch.Tensor], int | None, dict[str, Any]]:
    """(engine, HF model, prompt pool, EOS id, description) for ``--target``."""
    import dspark
    from dspark.engine import Engine
    from dspark.gating import DraftGate

    dtype = getattr(torch, args.dtype)
    if args.target == "tiny":
        from dspark.targets import HFTarget

        target = HFTarget(tiny_model().to(dtype))
        drafter, calibrator, label, cost = tiny_drafter(target).to(dtype), "identity", "tiny dspark (random)", flat_cost_model()
        g = torch.Generator().manual_seed(args.seed)
        pool = [torch.randint(0, target.vocab_size, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g)
                for _ in range(64)]
        eos, cost_desc = None, "flat packed profile (drafting always pays)"
    else:
        from dspark.engine import encode_prompt
        from dspark.evaluation.drafter_specs import load_drafter_spec
        from dspark.evaluation.inputs import eval_prompts
        from dspark.targets import load_target

        target = load_target("smollm2-135m", dtype)
        label, drafter, calibrator = load_drafter_spec(args.drafter, target)
        calibrator = calibrator or "identity"
        cost, cost_desc = "sps-table", "sps-table, the shipped default profile"
        pool = [encode_prompt(target.tokenizer, p.text) for p in eval_prompts(None, 1000)]
        eos = target.tokenizer.eos_token_id
    gate = None if args.no_gate else DraftGate()
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler(args.scheduler), cost_model=cost,
                    calibrator=calibrator, draft_gate=gate, seed=args.seed)
    desc = {"target": args.target, "dtype": args.dtype, "drafter": label, "gamma": drafter.gamma,
            "scheduler": args.scheduler, "draft_gate": gate is not None, "cost_model": cost_desc,
            "calibrated": calibrator != "identity", "max_context": target.max_context}
    return engine, target.model, pool, eos, desc


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm import tqdm

    from dspark.checkpoints import DEFAULT_DRAFTER

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256, help="submissions, the bad one included")
    ap.add_argument("--concurrency", type=int, default=64, help="most unfinished requests at a time")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="largest budget (budgets are 1..this)")
    ap.add_argument("--target", choices=("tiny", "smollm2"), default="smollm2")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="bfloat16: divergences on near-ties of the top-2 logits are accepted")
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER, help="shipped drafter / checkpoint (smollm2)")
    ap.add_argument("--scheduler", default="sps-greedy")
    ap.add_argument("--no-gate", action="store_true", help="draft every round (no DraftGate)")
    ap.add_argument("--bad", choices=("long", "empty"), default="long", help="the bad request's prompt")
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the scenario this many times through the same engine (seeds seed, seed+1, ...); "
                         "VmRSS after each run shows whether memory keeps growing")
    ap.add_argument("--reference-batch", type=int, default=32, help="prompts per batched reference decode")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/stress.json")
    args = ap.parse_args(argv)
    if args.requests < 8 or args.concurrency < 1 or args.max_new_tokens < 4 or args.repeats < 1:
        ap.error("need --requests >= 8, --concurrency >= 1, --max-new-tokens >= 4 and --repeats >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    rss: dict[str, Any] = {"start_kb": vm_rss_kb()}
    engine, model, pool, eos, desc = _setup(args)
    gc.collect()
    rss["loaded_kb"] = vm_rss_kb()
    samples: list[tuple[int, int, int | None, int]] = []  # (round, collected, VmRSS kB, held KV bytes)

    def sample(eng: Any, run: StressRun) -> None:
        kv = held_bytes(eng)
        samples.append((run.steps, len(run.completions), vm_rss_kb(), kv["target_kv"] + kv["drafter_kv"]))
        if "first_wave_kb" not in rss and len(run.completions) >= args.concurrency:
            rss["first_wave_kb"], rss["first_wave_round"] = samples[-1][2], run.steps

    runs, repeats = [], []
    for k in range(args.repeats):
        jobs = make_jobs(pool, args.requests, args.max_new_tokens, max_context=desc["max_context"],
                         seed=args.seed + k, abort_fraction=args.abort_fraction, bad=args.bad)
        valid = sum(j.bad is None for j in jobs)
        label = f"serving ({args.target}, {args.dtype}, c={args.concurrency}" + (f", run {k + 1})" if k else ")")
        with tqdm(total=valid, desc=label, unit="req") as bar:
            run = drive(engine, jobs, args.concurrency, progress=bar, on_step=sample if k == 0 else None)
        gc.collect()
        runs.append(run)
        repeats.append({"seed": args.seed + k, "seconds": run.seconds, "rss_after_kb": vm_rss_kb(),
                        "output_tokens": sum(len(c.output_ids) for c in run.completions.values())})
    run = runs[0]
    rss["after_run_kb"] = repeats[0]["rss_after_kb"]
    rss["peak_during_run_kb"] = max((s[2] for s in samples if s[2] is not None), default=None)
    rss["ru_maxrss_after_run_kb"] = peak_rss_kb()
    left = held_bytes(engine)
    t_ref = time.perf_counter()
    for k, (r, rep) in enumerate(zip(runs, repeats)):
        with tqdm(total=len(r.admitted), desc="reference greedy decode (batched HF generate)"
                  + (f", run {k + 1}" if k else ""), unit="req") as bar:
            rep["checks"] = check(r, model, eos, exact=args.dtype == "float32", batch_size=args.reference_batch,
                                  progress=bar)
    t_ref = time.perf_counter() - t_ref
    result = repeats[0]["checks"]
    ok = all(rep["checks"]["ok"] for rep in repeats)
    gc.collect()
    rss["after_reference_kb"] = vm_rss_kb()
    rss["ru_maxrss_kb"] = peak_rss_kb()
    if rss.get("first_wave_kb") and rss["after_run_kb"]:
        rss["after_run_minus_first_wave_mb"] = (rss["after_run_kb"] - rss["first_wave_kb"]) / 1024
    tokens = repeats[0]["output_tokens"]
    prompts = [j.prompt.numel() for j in run.jobs if j.bad is None]
    report = {
        "command": "python scripts/stress.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "setup": desc, "machine": {"cpu": platform.processor() or platform.machine(),
                                   "torch": torch.__version__, "threads": torch.get_num_threads()},
        "date": time.strftime("%Y-%m-%d"), "ok": ok,
        "requests": args.requests, "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": {"min": min(prompts), "max": max(prompts)},
        "serving": {"seconds": run.seconds, "output_tokens": tokens, "tokens_per_second": tokens / run.seconds,
                    "rounds": run.steps, "drafted_rounds": run.drafted_rounds, "gate_skipped_rounds": run.skipped_rounds,
                    "verified_drafts": run.verified_drafts, "accepted_drafts": run.accepted_drafts,
                    "max_active": run.max_active, "joins_mid_decode": run.joins_mid_decode},
        "reference_seconds": t_ref, "total_seconds": time.perf_counter() - t_start,
        "memory": {**rss, "held_after_run_bytes": left,
                   "peak_held_kv_bytes": max((s[3] for s in samples), default=0),
                   "samples_round_collected_rss_kb_kv_bytes": samples[:: max(1, len(samples) // 64)]},
        "checks": result,
    }
    if args.repeats > 1:
        report["repeats"] = [{**rep, "checks": {"ok": rep["checks"]["ok"]}} for rep in repeats]
        report["repeat_failures"] = {rep["seed"]: rep["checks"] for rep in repeats if not rep["checks"]["ok"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    s, m = report["serving"], report["memory"]
    print(f"{'OK' if result['ok'] else 'FAILED'}: {result['submitted']} submitted, {result['collected']} collected "
          f"({result['finish_reasons']}), lost {len(result['lost'])}, duplicates {len(result['duplicates'])}; "
          f"identical to greedy {result['identical_to_greedy']}, near-ties {len(result['near_tie_divergences'])}, "
          f"wrong {len(result['wrong'])}; aborted mid-decode {result['aborted_mid_decode']}; "
          f"bad rejected {result['bad_rejected_clearly']}/{result['bad']}")
    print(f"serving {s['seconds']:.1f} s, {s['output_tokens']} tokens ({s['tokens_per_second']:.1f} tok/s), "
          f"{s['rounds']} rounds ({s['drafted_rounds']} drafted), reference {t_ref:.1f} s")
    print("RSS MiB: " + ", ".join(f"{k.removesuffix('_kb')} {v / 1024:.0f}" for k, v in m.items()
                                  if k.endswith("_kb") and v is not None) + f"; wrote {out}")
    if args.repeats > 1:
        print(f"{'all' if ok else 'NOT all'} {args.repeats} runs OK; VmRSS MiB after each run: "
              + ", ".join(f"{rep['rss_after_kb'] / 1024:.0f}" for rep in repeats if rep["rss_after_kb"]))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
