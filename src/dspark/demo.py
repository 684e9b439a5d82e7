"""``dspark demo``: the README main job on the real SmolLM2-135M target with a shipped drafter.

1. Correctness (fp32): for a math, a code and a chat prompt, the target's own greedy decode (HF
   ``generate``) and the engine with the shipped DSpark drafter (calibrated, ``sps-greedy``) must
   be token-identical.
2. A sampling check at T = 0.8 / top-p 0.95: draft tokens drawn from a deliberately different
   distribution q are verified against the target's p; the committed tokens' total-variation
   distance to p is compared with that of plain samples from p (the noise floor) and of q itself.
   Drafts of full length are verified (the ``full`` scheduler), so accepted *and* rejected draft
   tokens occur; the report counts both.
3. Speed (concurrency 1, held-out prompts: by default the shipped natural-prompt eval set, which
   nothing was trained or calibrated on): the dtype is chosen by measurement at start-up unless
   ``--dtype`` fixes it — the one whose best fixed draft length promises the most tokens per second
   (:mod:`dspark.autotune`: the verification profile of each dtype, the acceptance survival of the
   identity rounds above, the drafter's round overhead timed on each) — and the cost model is the
   verification profile measured for that dtype on this machine. Plain decoding runs in *its* faster
   dtype (which may be the other one). Plain decoding — the best of HF ``generate`` (in both dtypes
   when they differ) and the engine without a drafter — against the engine with the drafter and the
   draft gate (which stops drafting where the measured rates say it does not pay), side by side, prompt
   by prompt, repeated; the speed-up is the median over repeats of the summed wall-clock times. The
   report states the machine (CPU, the ISA flags that matter, threads, dtype) next to the figure.
Writes ``demo.json`` and ``demo.md`` to ``--out``. The library function is :func:`run_demo` (a
:class:`DemoOptions` in, a :class:`DemoResult` out).
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import frozen
from tqdm import tqdm

from dspark.autotune import DTYPES, choose_dtype
from dspark.checkpoints import DEFAULT_DRAFTER
from dspark.demo_report import demo_markdown
from dspark.gate_forecast import GatePrior
from dspark.models import load_causal_lm
from dspark.options import (
    COMPILE_HELP,
    DEVICE_HELP,
    DRAFTER_HELP,
    GATE_HELP,
    RACED_STEP_HELP,
    STEP_PATHS,
    TARGET_HELP,
    NamespaceOptions,
    at_least,
    existing_device,
    flag_name,
    option,
    optional_path,
    path,
    race_paths,
    resolve_options,
)
from dspark.profiling import device_name
from dspark.sampling import probs_from_logits, sample
from dspark.speculative import plain_generate
from dspark.types import SamplingParams
from dspark.verify import verify

__all__ = ["DemoOptions", "DemoResult", "run_demo"]

log = logging.getLogger(__name__)


@frozen
class DemoOptions(NamespaceOptions):
    """What ``dspark demo`` runs: each field is an option of the command (:func:`dspark.options.option`)."""

    drafter: str = option(DEFAULT_DRAFTER, converter=path, metavar="NAME|DIR", help=DRAFTER_HELP)
    max_new_tokens: int = option(96, validator=at_least(1), help="tokens generated per prompt")
    per_domain: int = option(2, validator=at_least(1), help="held-out prompts per domain for the speed run")
    repeats: int = option(3, validator=at_least(1), help="side-by-side repeats (the median is reported)")
    samples: int = option(4000, validator=at_least(1), help="draws for the sampling check")
    dtype: str = option("auto", choices=("auto", "float32", "bfloat16"),
                        help="target dtype for the speed run ('auto': the faster plain step, measured at start-up)")
    step: str = option("auto", choices=("auto", *STEP_PATHS), help=RACED_STEP_HELP)
    compile: bool | None = option(None, help=COMPILE_HELP)  # None: on a GPU only
    gate: bool = option(True, help=GATE_HELP)
    vocab_cut: bool = option(True, help="where the compiled step races, race the drafter's measured vocabulary cut "
                             "(vocab_cut.json beside its weights, within 1 %% of its τ) against it "
                             "(docs/drafters-and-training.md)")
    scheduler: str = option("sps-greedy", validator=lambda _i, _a, v: _scheduler(v),
                            help="the speculative engine's scheduler, NAME[:KEY=VALUE,...] (e.g. sps-greedy:sunk=true, "
                            "docs/scheduling-and-calibration.md)")
    out: str = option("out/demo", converter=path, help="folder for demo.json and demo.md")
    model: str = option("smollm2-135m", converter=path, flag="--target", help=TARGET_HELP)
    prompts: str | None = option(None, converter=optional_path,
                                 help="prompts JSONL for the speed run (default: the shipped natural-prompt eval "
                                 "set, src/dspark/data/natural_eval.jsonl; the templated one: "
                                 "src/dspark/checkpoints/smollm2-135m/eval_prompts.jsonl)")
    device: str = option("cpu", validator=existing_device, help=DEVICE_HELP)


@frozen
class DemoResult:
    """What :func:`run_demo` wrote to ``out``: ``result`` is ``demo.json`` and ``markdown`` is
    ``demo.md``."""

    out: Path
    result: dict[str, Any]
    markdown: str

    @property
    def all_identical(self) -> bool:
        """Every fp32 speculative decode equalled the target's own greedy decode."""
        return bool(self.result["all_identical"])

    @property
    def speedup(self) -> float:
        """Wall-clock speed-up over the best plain decode (concurrency 1)."""
        return float(self.result["speed"]["speedup_vs_best_plain"])


PROMPTS = {
    "math": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May? Show each step.",
    "code": "Complete this Python function and repeat its signature exactly:\n\n"
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n",
    "chat": "Give me three tips for writing clear emails, one sentence each.",
}


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def _sampling_check(model, prompt_ids: torch.Tensor, n: int, seed: int) -> dict:
    """Verify n single-token drafts from q against p and measure how far the result is from p."""
    with torch.inference_mode():
        logits = model(input_ids=prompt_ids[None, :].to(model.device)).logits[0, -1].cpu()  # [V], drawn on the CPU
    p1 = probs_from_logits(logits[None], 0.8, 0, 0.95)[0]  # [V] target at T=0.8, top-p 0.95
    q1 = probs_from_logits(logits[None], 1.6, 0, 0.95)[0]  # [V] a deliberately flatter draft
    g = torch.Generator().manual_seed(seed)
    V, chunk = p1.numel(), 500
    committed, plain, drafts, accepted = [], [], [], 0
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        x = sample(q1.expand(m, V), g)  # [m] draft tokens ~ q
        res = verify(x[:, None], q1.expand(m, 1, V), p1.expand(m, 2, V), torch.ones(m, dtype=torch.long), g)
        committed.append(res.committed[:, 0])
        accepted += int(res.accepted.sum())
        drafts.append(x)
        plain.append(sample(p1.expand(m, V), g))

    def emp(t):
        return torch.bincount(torch.cat(t), minlength=V).float() / n

    return {
        "samples": n,
        "acceptance_rate": accepted / n,
        "overlap_sum_min_p_q": float(torch.minimum(p1, q1).sum()),
        "tv_committed_vs_p": _tv(emp(committed), p1),
        "tv_plain_samples_vs_p": _tv(emp(plain), p1),
        "tv_draft_samples_vs_p": _tv(emp(drafts), p1),
    }


def _load_drafter(ref, target) -> Any:
    """``ref``: (checkpoint folder, K of a ``:vocab=K`` variant or None)."""
    from dspark.drafters.checkpoint import from_pretrained

    return from_pretrained(ref[0], target, draft_vocab=ref[1])


def _variant(folder, draft_vocab: int | None) -> tuple:
    """The folder's drafter (``draft_vocab`` None) or its ``:vocab=K`` variant as the demo runs it:
    (ref, report label, calibrator — None under a calibrated confidence.json —, calibration label)."""
    from dspark.drafters.checkpoint import folder_confidence_model
    from dspark.drafters.prune import variant_label
    from dspark.evaluation.drafter_specs import calibration_label, calibrator_beside

    own = folder_confidence_model(folder, draft_vocab)
    calibrator = calibrator_beside(folder, own)
    return (folder, draft_vocab), variant_label(folder.name, draft_vocab), calibrator, calibration_label(calibrator, own)


def _engine(model, tok, ref, calibrator, cost, scheduler="sps-greedy", gate=False, prior=None, step="packed",
            drafter=None):
    """An engine on a fresh target around ``model`` whose step runs on ``step`` (plain decoding
    when ``ref`` is None, else the drafter (folder, draft vocabulary) ``ref``, or ``drafter`` when
    one was already loaded for this model; the engines must not share a target: each keeps its
    own per-request caches; targets on one model share its packed or compiled step); ``prior``:
    the draft gate's :class:`~dspark.gate_forecast.GatePrior`."""
    from dspark.engine import Engine
    from dspark.fast import build_target
    from dspark.gating import DraftGate

    target = build_target(model, tok, path=step)
    if drafter is None and ref is not None:
        drafter = _load_drafter(ref, target)
    return Engine(target, drafter, scheduler=scheduler, cost_model=cost, calibrator=calibrator or "identity",
                  draft_gate=DraftGate(prior=prior) if gate and drafter is not None else None)


def _scheduler(spec: str) -> Any:
    """``NAME[:KEY=VALUE,...]`` (e.g. ``sps-greedy:sunk=true``) → the built scheduler."""
    from dspark.bench.runner import build_lossless, parse_scheduler_spec

    parsed = parse_scheduler_spec(spec)
    if parsed.plain:
        raise ValueError("scheduler 'plain': the demo already runs plain decoding side by side")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a lossy scheduler's warning: refused with the reason instead
        return build_lossless(parsed, "the demo checks the target's own outputs")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _identity(model, tok, ref, calibrator, encoded, max_new_tokens, eos) -> tuple[list[dict], int, tuple]:
    """fp32 greedy identity with every draft verified at full length (``full`` scheduler) → (rows,
    γ, the acceptance survival s_j over those rounds: every position was verified)."""
    from dspark.autotune import full_block_survival

    engine = _engine(model, tok, ref, calibrator, None, scheduler="full")
    rows, accepted, proposed = [], [], []
    for domain, ids in tqdm(encoded.items(), desc="greedy identity (fp32, full drafts)", leave=False):
        reference = plain_generate(model, ids, max_new_tokens, eos)
        (c,) = engine.generate([ids], SamplingParams.greedy(), max_new_tokens=max_new_tokens, progress=False)
        m = c.rounds
        accepted += m.accepted
        proposed += m.proposed
        rows.append({"domain": domain, "identical_to_target_greedy": c.output_ids == reference,
                     "new_tokens": len(c.output_ids), "verified_drafts": sum(m.verified),
                     "accepted_drafts": sum(m.accepted),
                     "rejected_drafts": sum(1 for v, a in zip(m.verified, m.accepted) if a < v), **c.metrics})
    gamma = engine.drafter.gamma
    return rows, gamma, full_block_survival(accepted, proposed, gamma)


def _speculation(ref, calibrator, survival, ids) -> Any:
    """The dtype race's :class:`~dspark.autotune.Speculation`: the identity rounds' survival and
    the drafter's round overhead timed on each candidate target (8 rounds drafting γ against 8
    plain ones, one request)."""
    from dspark.autotune import Speculation
    from dspark.bench.prior import measure_draft_overhead

    def overhead(target, cost) -> float:
        drafter = _load_drafter(ref, target)
        return measure_draft_overhead(target, drafter, ids, [1], cost, calibrator, rounds=8).get(1, 0.0)

    return Speculation(survival, overhead)


def run_demo(options: DemoOptions | None = None, /, **overrides: Any) -> DemoResult:
    """The README main job (module docstring): greedy identity in fp32, the sampling check and
    the speed-up at concurrency 1; writes ``demo.json`` and ``demo.md`` to ``options.out``.
    ``overrides`` replace fields of ``options`` (or of the defaults)."""
    from dspark.checkpoints import resolve_checkpoint
    from dspark.data.natural.common import SHIPPED_EVAL
    from dspark.data.prompts import prompt_request
    from dspark.drafters.prune import parse_drafter_ref
    from dspark.engine import encode_prompt
    from dspark.evaluation.inputs import eval_prompts

    opts = resolve_options(DemoOptions, options, overrides)
    prompt_file = opts.prompts or str(SHIPPED_EVAL)
    prompts = eval_prompts(prompt_file, opts.per_domain)  # a bad file fails here, before any model loads
    torch.manual_seed(0)
    name, draft_vocab = parse_drafter_ref(opts.drafter)
    folder = resolve_checkpoint(name)
    ref, label, calibrator, calibration = _variant(folder, draft_vocab)
    greedy = SamplingParams.greedy()

    # 1–2. correctness, fp32 ------------------------------------------------------------------
    log.info("loading target %s (fp32) and drafter %s ...", opts.model, label)
    model, tok = load_causal_lm(opts.model, torch.float32, opts.device)
    eos = tok.eos_token_id
    encoded = {name: encode_prompt(tok, text) for name, text in PROMPTS.items()}
    identity, gamma, survival = _identity(model, tok, ref, calibrator, encoded, opts.max_new_tokens, eos)
    all_identical = all(r["identical_to_target_greedy"] for r in identity)
    check = _sampling_check(model, encoded["chat"], opts.samples, seed=0)

    # 3. speed, concurrency 1, dtype by measurement ---------------------------------------------
    ids = [encode_prompt(tok, prompt_request(p)) for p in prompts]
    context = round(statistics.mean(x.numel() for x in ids)) + opts.max_new_tokens // 2
    choice, target = choose_dtype(model, tok, context=context, gamma=gamma, dtype=opts.dtype,
                                  paths=race_paths(opts.step, opts.compile, opts.device),
                                  speculation=_speculation(ref, calibrator, survival, ids[:2]))
    # plain decoding in its own faster dtype: the baseline is the best plain decode on this machine
    plain_model = (target.model if choice.plain_dtype == choice.dtype
                   else copy.deepcopy(model).to(DTYPES[choice.plain_dtype]))
    del model
    model = target.model
    log.info("%s", choice.reason)
    cost = choice.cost_model(opts.model)
    log.info("%s verification step time by tokens verified: %s", choice.label,
             ", ".join(f"q={b}: {s * 1e3:.0f} ms" for b, s in choice.profile.items()))
    plain_engine = _engine(plain_model, tok, None, None, cost, step=choice.plain_path)
    # the gate starts from what the start-up measured (as dspark bench's --gate-prior): the identity
    # rounds' survival and the round overhead timed in the chosen dtype, so it forecasts from round 1
    overhead = choice.speculative[choice.label]["overhead_seconds"]
    drafter, runner, vocab_race, identity_label = None, None, None, label
    # where the compiled step races, the drafter's runner races too: eager, compiled and onnxruntime
    # (skipped in one sentence where it cannot run, e.g. a bf16 drafter)
    if "compiled" in race_paths(opts.step, opts.compile, opts.device):
        from dspark.fast import build_target
        from dspark.fast.drafter import fastest_drafter

        race_target = build_target(model, tok, path=choice.path)
        setup = fastest_drafter(folder, race_target, ids[:2], cost, choice.profile[gamma + 1], draft_vocab=draft_vocab,
                                race_cut=opts.vocab_cut)
        drafter, runner, vocab_race, overhead = setup.drafter, setup.runner, setup.vocab_race, setup.overhead_seconds
        if setup.draft_vocab != draft_vocab:  # the cut won
            ref, label, calibrator, calibration = _variant(folder, setup.draft_vocab)
    prior = GatePrior(survival, {1: overhead})
    spec_engine = _engine(model, tok, ref, calibrator, cost, scheduler=_scheduler(opts.scheduler), gate=opts.gate,
                          prior=prior, step=choice.path, drafter=drafter)
    if spec_engine.target.path == "compiled":  # each class compiled before the timed runs (one request each)
        from dspark.fast.warm import warm_up

        warm_up(spec_engine.target, spec_engine.drafter, ids[0], batch_sizes=(1,), cost_model=cost)
    # HF generate in both dtypes when they differ (the start-up race is a few steps: noisy)
    hf_models = {"hf_generate": plain_model}
    if plain_model is not model:
        hf_models[f"hf_generate_{choice.dtype}"] = model
    totals: dict[str, list[float]] = {k: [] for k in [*hf_models, "engine_plain", "engine_dspark"]}
    per_prompt, taus, match = [], [], []
    bar = tqdm(total=opts.repeats * len(ids), desc=f"speed ({choice.dtype}, concurrency 1)", leave=False)
    for rep in range(opts.repeats):
        sums = dict.fromkeys(totals, 0.0)
        for p, x in zip(prompts, ids):
            for name, m_hf in hf_models.items():
                ref, t_hf = _timed(lambda x=x, m_hf=m_hf: plain_generate(m_hf, x, opts.max_new_tokens, eos))
                sums[name] += t_hf * opts.max_new_tokens / max(len(ref), 1)  # per token budget
            (cp,), t_plain = _timed(lambda x=x: plain_engine.generate([x], greedy, opts.max_new_tokens, progress=False))
            (cs,), t_spec = _timed(lambda x=x: spec_engine.generate([x], greedy, opts.max_new_tokens, progress=False))
            sums["engine_plain"] += t_plain * opts.max_new_tokens / max(len(cp.output_ids), 1)
            sums["engine_dspark"] += t_spec * opts.max_new_tokens / max(len(cs.output_ids), 1)
            if rep == 0:
                taus.append(cs.metrics["tau"])
                n = min(len(cs.output_ids), len(cp.output_ids))
                first = next((i for i in range(n) if cs.output_ids[i] != cp.output_ids[i]), n)
                match.append(first / max(n, 1))
                drafted = sum(1 for v in cs.rounds.proposed if v > 0)
                per_prompt.append({"domain": p.domain, "tau": cs.metrics["tau"], "new_tokens": len(cs.output_ids),
                                   "mean_verified": cs.metrics["mean_verified"],
                                   "drafted_rounds": drafted, "rounds": cs.metrics["rounds"],
                                   "ms_per_token_plain": 1e3 * t_plain / max(len(cp.output_ids), 1),
                                   "ms_per_token_dspark": 1e3 * t_spec / max(len(cs.output_ids), 1)})
            bar.update()
        for k in totals:
            totals[k].append(sums[k])
    bar.close()
    gate = spec_engine.draft_gate
    med = {k: statistics.median(v) for k, v in totals.items()}
    plain_runs = {k: v for k, v in med.items() if k != "engine_dspark"}
    baseline_name = min(plain_runs, key=plain_runs.__getitem__)
    speedup = plain_runs[baseline_name] / med["engine_dspark"]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "model": opts.model, "drafter": label, "identity_drafter": identity_label,
        "calibrated": calibration is not None,
        "calibration": calibration, "gamma": gamma,
        "max_new_tokens": opts.max_new_tokens, "machine": choice.machine.to_dict(),
        "device": device_name(target), "device_type": model.device.type,
        "greedy_identity_fp32": identity, "all_identical": all_identical,
        "identity_verified_drafts": sum(r["verified_drafts"] for r in identity),
        "identity_accepted_drafts": sum(r["accepted_drafts"] for r in identity),
        "sampling_check": check, "dtype_choice": choice.to_dict(),
        "draft_runner": runner.to_dict() if runner is not None else None,
        "vocab_race": vocab_race,
        "speed": {"dtype": choice.dtype, "step": choice.path, "plain_step": choice.plain_path, "prompts": len(ids), "prompt_file": Path(prompt_file).name,
                  "repeats": opts.repeats,
                  "draft_gate": gate is not None, "scheduler": opts.scheduler, "seconds_per_repeat": totals,
                  "gate_rounds": {"rounds": spec_engine.rounds,
                                  "skipped": gate.skipped_rounds if gate else 0,
                                  "hopeless": gate.hopeless_rounds if gate else 0},
                  "median_seconds": med, "baseline": baseline_name, "plain_dtype": choice.plain_dtype,
                  "gate_prior": prior.to_dict(),
                  "speedup_vs_best_plain": speedup, "mean_tau": statistics.mean(taus),
                  "prefix_agreement_with_plain": statistics.mean(match), "per_prompt": per_prompt},
        # ISA caps in the environment (they emulate an older CPU) are part of the command
        "command": " ".join([*choice.machine.caps, "dspark demo"]) + " "
        + " ".join(_flag(f, getattr(opts, f.name)) for f in attrs.fields(DemoOptions)
                   if getattr(opts, f.name) is not None),
    }
    (out / "demo.json").write_text(json.dumps(result, indent=2) + "\n")
    md = demo_markdown(result)
    (out / "demo.md").write_text(md)
    return DemoResult(out, result, md)


def _flag(attribute: attrs.Attribute, value) -> str:
    name = flag_name(attribute)
    if isinstance(value, bool):
        return name if value else "--no-" + name[2:]
    return f"{name} {value}"
