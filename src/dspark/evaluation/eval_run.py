"""``dspark eval`` as a library function: :func:`evaluate` (an :class:`EvalOptions` in, an
:class:`EvalResult` out) measures drafters per domain and temperature on held-out prompts, every
draft position verified, and writes the rounds and the reports."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from attrs import frozen

from dspark.evaluation.drafter_specs import (
    calibration_label,
    check_drafter_spec,
    load_drafter_spec,
    spec_label,
)
from dspark.evaluation.inputs import eval_prompts, load_eval_target, prompt_keys_digest, sampling_at
from dspark.evaluation.reports import eval_markdown, plot_acceptance
from dspark.options import (
    DEVICE_HELP,
    TARGET_HELP,
    NamespaceOptions,
    at_least,
    existing_device,
    floats,
    option,
    optional_path,
    path,
    resolve_options,
    strings,
)

__all__ = ["THRESHOLDS", "EvalOptions", "EvalResult", "evaluate", "rounds_path"]

THRESHOLDS = [round(0.05 * i, 2) for i in range(1, 20)]
"""The survival thresholds θ of the threshold sweep in ``eval.json``."""


def rounds_path(out: str | Path, label: str, temperature: float) -> Path:
    """Where ``dspark eval --out OUT`` keeps one drafter's rounds at one temperature."""
    return Path(out) / "rounds" / f"{label}-T{float(temperature)}.json"


def _drafters(_inst: Any, a: Any, v: tuple[str, ...]) -> None:
    if not v or not all(isinstance(x, str) and x.strip() for x in v):
        raise ValueError(f"{a.name} must name at least one drafter (LABEL=CHECKPOINT, a folder, a shipped "
                         f"name or ngram), got {v!r}")


def _temperatures(_inst: Any, a: Any, v: tuple[float, ...]) -> None:
    if not v or any(t < 0 for t in v):
        raise ValueError(f"{a.name} must be one or more numbers ≥ 0, got {v!r}")


@frozen
class EvalOptions(NamespaceOptions):
    """What ``dspark eval`` measures: each field is an option of the command
    (:func:`dspark.options.option`). ``drafters`` (``--drafter``, repeatable) has no default;
    ``temperatures`` is ``--temperature``."""

    drafters: tuple[str, ...] = option(converter=strings, validator=_drafters, flag="--drafter", append=True, metavar="NAME|DIR",
                                       help="[LABEL=]NAME|DIR, repeatable: a shipped drafter's name, a checkpoint "
                                       "folder or ngram, labelled LABEL in the reports (NAME:vocab=K: cut to its K "
                                       "most frequent tokens, docs/drafters-and-training.md)")
    temperatures: tuple[float, ...] = option((0.0,), converter=floats, validator=_temperatures, flag="--temperature",
                                             metavar="TEMPERATURE", help="sampling temperatures (0: greedy)")
    out: str = option("out/eval", converter=path, help="folder for eval.json, eval.md, acceptance.png, rounds/")
    fresh: bool = option(False, help="recompute runs already recorded under OUT/rounds")
    prompts: str | None = option(None, converter=optional_path,
                                 help="held-out prompts JSONL (default: the shipped SmolLM2 eval prompts)")
    per_domain: int = option(12, validator=at_least(1), help="prompts per domain")
    max_new_tokens: int = option(96, validator=at_least(1), help="tokens generated per prompt")
    concurrency: int = option(8, validator=at_least(1), help="prompts decoded at once")
    model: str = option("smollm2-135m", converter=path, flag="--target", help=TARGET_HELP)
    dtype: str = option("float32", choices=("float32", "bfloat16"), help="the target's dtype")
    device: str = option("cpu", validator=existing_device, help=DEVICE_HELP)
    seed: int = option(0, help="random seed")
    quiet: bool = False  # the global -q


@frozen
class EvalResult:
    """What :func:`evaluate` wrote to ``out``: ``results`` is ``eval.json`` (per run
    ``"LABEL@T=temperature"``: τ, acceptance, survival, confidence metrics per domain and overall)."""

    out: Path
    results: dict[str, Any]

    @property
    def json_path(self) -> Path:
        return self.out / "eval.json"

    @property
    def markdown_path(self) -> Path:
        return self.out / "eval.md"

    @property
    def tau(self) -> dict[str, float]:
        """Overall τ (mean committed tokens per round) per run."""
        return {k: r["overall"]["tau"] for k, r in self.results["runs"].items()}


def evaluate(options: EvalOptions | None = None, /, **overrides: Any) -> EvalResult:
    """Evaluate drafters per domain at each temperature on held-out prompts (every draft position
    verified): τ, proposal length, conditional acceptance and prefix survival per position,
    threshold sweep, confidence metrics; writes ``eval.json``, ``eval.md``, ``acceptance.png`` and
    the rounds (reused by a re-run unless ``fresh``) to ``options.out``. ``overrides`` replace
    fields of ``options`` (or give all of them: ``drafters=[...]``, ...)."""
    from dspark.evaluation.round_metrics import evaluate_rounds
    from dspark.evaluation.rounds import Rounds, collect_rounds, save_json
    from dspark.provenance import check, files_digest, record

    opts = resolve_options(EvalOptions, options, overrides)
    # a missing checkpoint or prompt file, a bad or repeated label: refused before the model loads
    digests = {spec: check_drafter_spec(spec) for spec in opts.drafters}
    labels = [spec_label(spec) for spec in opts.drafters]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ValueError(f"drafter label {repeated[0]!r} is given twice; name each with LABEL=CHECKPOINT")
    prompts = eval_prompts(opts.prompts, opts.per_domain)
    prompt_file = opts.prompts or "shipped"
    base = {"model": opts.model, "dtype": opts.dtype, "device": opts.device, "prompts": prompt_file,
            "prompts_digest": files_digest(opts.prompts) if opts.prompts else "shipped",
            "prompt_keys": prompt_keys_digest(prompts), "max_new_tokens": opts.max_new_tokens,
            "concurrency": opts.concurrency, "seed": opts.seed}
    target = load_eval_target(opts.model, opts.dtype, opts.device)
    out = Path(opts.out)
    results: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": opts.max_new_tokens,
                               "model": opts.model, "dtype": opts.dtype,
                               "command": " ".join(["dspark", *sys.argv[1:]]), "runs": {}}
    drafters = [load_drafter_spec(spec, target) for spec in opts.drafters]  # once, for every temperature
    out.mkdir(parents=True, exist_ok=True)  # only once the drafters loaded: a failure leaves no empty folder
    for temp in opts.temperatures:
        for spec, (label, drafter, cal) in zip(opts.drafters, drafters):
            cache = rounds_path(out, label, temp)
            provenance = {**base, "drafter": spec, "checkpoint_digest": digests[spec], "temperature": temp,
                          "gamma": drafter.gamma}
            sidecar = cache.with_suffix(".provenance.json")
            if cache.is_file() and not opts.fresh:  # resumable: finished runs are not redone
                import json

                check(sidecar, provenance, f"{cache}", "pass --fresh to recompute it, or choose another --out")
                rounds = Rounds.from_dict(json.loads(cache.read_text()))
            else:
                rounds = collect_rounds(target, drafter, prompts, sampling_at(temp), max_new_tokens=opts.max_new_tokens,
                                        concurrency=opts.concurrency, progress=not opts.quiet, seed=opts.seed)
                save_json(rounds.to_dict(), cache)
                record(sidecar, provenance)
            res = evaluate_rounds(rounds, cal, THRESHOLDS)
            res["calibrated_with"] = calibration_label(cal, getattr(drafter, "confidence_model", None))
            results["runs"][f"{label}@T={temp}"] = {"drafter": label, "temperature": temp, "provenance": provenance,
                                                    **res}
            print(f"{label:>16} T={temp}: τ {res['overall']['tau']:.3f} "
                  + " ".join(f"{d}={v['tau']:.2f}" for d, v in res["domains"].items()), file=sys.stderr)
    save_json(results, out / "eval.json")
    (out / "eval.md").write_text(eval_markdown(results))
    plot_acceptance(results, out / "acceptance.png")
    return EvalResult(out, results)
