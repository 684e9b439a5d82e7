"""``dspark calibrate`` as a library function: :func:`calibrate` (a :class:`CalibrateOptions` in, a
:class:`CalibrateResult` out) runs a drafter on held-out prompts, fits calibrators on half of its
rounds and ships the simplest that scores as well as the best on the other half."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from attrs import frozen

from dspark.evaluation.drafter_specs import (
    check_drafter_spec,
    load_drafter_spec,
    spec_path,
    split_label,
)
from dspark.evaluation.inputs import calibration_split, eval_prompts, load_eval_target, sampling_at
from dspark.evaluation.reports import calibration_markdown
from dspark.options import (
    DEVICE_HELP,
    DRAFTER_HELP,
    TARGET_HELP,
    NamespaceOptions,
    at_least,
    existing_device,
    option,
    optional_path,
    path,
    resolve_options,
)

__all__ = ["BIAS_MARGIN", "CALIBRATORS", "CalibrateOptions", "CalibrateResult", "calibrate", "simplest_within_margin"]

CALIBRATORS = ("identity", "sts", "sts-bias")
"""What ``calibrator="best"`` fits and compares, simplest first."""
BIAS_MARGIN = 0.001
"""Mean held-out ECE by which a calibrator must beat every simpler one to be shipped (0.1 points)."""


@frozen
class CalibrateOptions(NamespaceOptions):
    """What ``dspark calibrate`` fits: each field is an option of the command
    (:func:`dspark.options.option`). ``checkpoint`` (``--drafter``: a checkpoint folder or a shipped
    drafter's name) has no default."""

    checkpoint: str = option(converter=path, flag="--drafter", metavar="NAME|DIR", help=DRAFTER_HELP)
    out: str | None = option(None, converter=optional_path,
                             help="folder for calibration.json and the report (default: the checkpoint)")
    temperature: float = option(0.0, validator=at_least(0, integer=False), help="sampling temperature (0: greedy)")
    objective: str = option("ece", choices=("ece", "brier"),
                            help="STS fit: per-position survival ECE (paper) or Brier score")
    calibrator: str = option("best", choices=("best", *CALIBRATORS),
                             help="compare raw (identity), STS and STS + bias on the held-out half and ship the "
                             "simplest within 0.1 points of the lowest mean ECE (best), or fit only the one named")
    bins: int = option(20, validator=at_least(1), help="equal-width bins of the ECE (the paper's 20)")
    reuse_rounds: bool = option(False, help="refit on OUT/calibration_rounds.json from an earlier run instead of "
                                "decoding again")
    skip: int = option(12, validator=at_least(0),
                       help="skip the first N prompts of each domain: the ones `dspark eval --per-domain N` uses")
    prompts: str | None = option(None, converter=optional_path,
                                 help="held-out prompts JSONL (default: the shipped SmolLM2 eval prompts)")
    per_domain: int = option(40, validator=at_least(1), help="prompts per domain")
    max_new_tokens: int = option(96, validator=at_least(1), help="tokens generated per prompt")
    concurrency: int = option(16, validator=at_least(1), help="prompts decoded at once")
    model: str = option("smollm2-135m", converter=path, flag="--target", help=TARGET_HELP)
    dtype: str = option("float32", choices=("float32", "bfloat16"), help="the target's dtype")
    device: str = option("cpu", validator=existing_device, help=DEVICE_HELP)
    seed: int = option(0, help="random seed")
    quiet: bool = False  # the global -q


@frozen
class CalibrateResult:
    """What :func:`calibrate` wrote to ``out``: the fitted STS calibrator (``calibration.json``)
    and the report on the held-out half (``calibration_report.json``)."""

    out: Path
    calibrator: Any
    report: dict[str, Any]

    @property
    def calibration_path(self) -> Path:
        return self.out / "calibration.json"


def calibrate(options: CalibrateOptions | None = None, /, **overrides: Any) -> CalibrateResult:
    """Run a drafter against the target on held-out prompts (every position verified), fit STS
    and STS + per-position bias on half of them and report them and the raw confidences on the
    other half; ships the simplest of raw < STS < STS + bias within :data:`BIAS_MARGIN` of the lowest
    mean held-out survival ECE (``calibrator="best"``) or the one named. Writes
    ``calibration.json``, the report (Markdown, JSON), the rounds and ``reliability.png`` to
    ``options.out`` (default: the checkpoint folder). ``overrides`` replace fields of ``options``
    (or give all: ``checkpoint=``)."""
    import torch

    from dspark.checkpoints import resolve_checkpoint
    from dspark.drafters.prune import parse_drafter_ref
    from dspark.evaluation.round_metrics import evaluate_rounds
    from dspark.evaluation.rounds import Rounds, collect_rounds, save_json
    from dspark.metrics import ece_noise_floor, survival_labels, verified_mask
    from dspark.plotting import reliability_diagram

    opts = resolve_options(CalibrateOptions, options, overrides)
    check_drafter_spec(opts.checkpoint)  # a missing checkpoint or prompt file fails before the model loads
    if not opts.out and parse_drafter_ref(split_label(opts.checkpoint)[1])[1] is not None:
        raise ValueError(f"{opts.checkpoint}: a ':vocab=K' variant shares its folder with the full drafter; "
                         "give --out so its calibration does not replace the folder's calibration.json")
    out = Path(opts.out) if opts.out else resolve_checkpoint(spec_path(opts.checkpoint))
    rounds_path = out / "calibration_rounds.json"
    if opts.reuse_rounds and not rounds_path.is_file():
        raise FileNotFoundError(f"--reuse-rounds: {rounds_path} does not exist (run `dspark calibrate` "
                                "once without it to decode and save the rounds)")
    if opts.reuse_rounds:  # refit on the rounds a previous run collected
        import json

        try:
            saved = json.loads(rounds_path.read_text())
            fit_r, test_r = Rounds.from_dict(saved["fit"]), Rounds.from_dict(saved["test"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            what = f"no {exc.args[0]!r} entry" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            raise ValueError(f"--reuse-rounds: {rounds_path} is not a calibration rounds file written by "
                             f"`dspark calibrate` ({what}); run without --reuse-rounds to decode again") from None
        label = saved.get("drafter", opts.checkpoint)
        n_fit_p, n_test_p = saved.get("fit_prompts"), saved.get("test_prompts")
    else:
        prompts = eval_prompts(opts.prompts, opts.per_domain, skip=opts.skip)
        target = load_eval_target(opts.model, opts.dtype, opts.device)
        label, drafter, _ = load_drafter_spec(opts.checkpoint, target)
        # fit on half of the held-out prompts, report on the other half (split by prompt hash)
        fit_p, test_p = calibration_split(prompts)
        sampling = sampling_at(opts.temperature)
        # calibration.json calibrates the logits the engine reads from the folder: the head's (what
        # vLLM / TensorRT-LLM read too) beside a confidence.json that is calibrated itself
        own = getattr(drafter, "confidence_model", None)
        kw = dict(max_new_tokens=opts.max_new_tokens, concurrency=opts.concurrency, progress=not opts.quiet,
                  confidence_model="draft-head" if getattr(own, "calibrated", False) else None)
        fit_r = collect_rounds(target, drafter, fit_p, sampling, **kw)
        test_r = collect_rounds(target, drafter, test_p, sampling, **kw)
        n_fit_p, n_test_p = len(fit_p), len(test_p)
        out.mkdir(parents=True, exist_ok=True)
        save_json({"fit": fit_r.to_dict(), "test": test_r.to_dict(), "drafter": label,  # refits need no rerun
                   "fit_prompts": n_fit_p, "test_prompts": n_test_p}, rounds_path)
    names = CALIBRATORS if opts.calibrator == "best" else (opts.calibrator,)
    fitted = {n: _fit_candidate(n, fit_r, opts) for n in names}
    reports = {n: evaluate_rounds(test_r, c, n_bins=opts.bins) for n, c in fitted.items()}
    mean_ece = {n: _nanmean(r["overall"]["calibrated"]["ece"]) for n, r in reports.items()}
    chosen = simplest_within_margin(mean_ece, names)
    cal, report = fitted[chosen], reports[chosen]
    z = test_r.confidence_logits.float()
    gamma = z.shape[1]
    y, _ = survival_labels(test_r.accepted, gamma, test_r.verified)
    mask = verified_mask(test_r.accepted, gamma, test_r.verified)
    survival = {n: torch.cumprod(c.calibrate(z).float(), 1) for n, c in fitted.items()}  # [N, γ] each, held out
    floor = [ece_noise_floor(survival[chosen][mask[:, k], k], opts.bins) for k in range(gamma)]
    out.mkdir(parents=True, exist_ok=True)
    cal.save(out / "calibration.json")
    report.update({"drafter": label, "fit_rounds": len(fit_r.domain), "test_rounds": len(test_r.domain),
                   "n_bins": opts.bins, "ece_noise_floor": floor, "calibrator": chosen, "temperatures": list(getattr(cal, "temperatures", ())),
                   "biases": list(getattr(cal, "biases", ())),
                   "candidates": {n: {"temperatures": list(getattr(c, "temperatures", ())), "biases": list(getattr(c, "biases", ())),
                                      "mean_ece": mean_ece[n], "calibrated": reports[n]["overall"]["calibrated"]}
                                  for n, c in fitted.items()},
                   "command": " ".join(["dspark", *sys.argv[1:]])})
    save_json(report, out / "calibration_report.json")
    markdown = calibration_markdown(report, fitted, reports, mean_ece, fit_prompts=n_fit_p, test_prompts=n_test_p,
                                    compared=len(names) > 1, margin=BIAS_MARGIN)
    (out / "calibration_report.md").write_text(markdown)
    curves = {"raw": (torch.cumprod(torch.sigmoid(z), 1), y, mask)}
    curves.update({n: (a, y, mask) for n, a in survival.items() if n != "identity"})  # identity is raw
    reliability_diagram(curves, out / "reliability.png", title=f"{label}: prefix survival, held-out rounds")
    return CalibrateResult(out, cal, report)


def _fit_candidate(name: str, rounds: Any, opts: CalibrateOptions) -> Any:
    from dspark.evaluation.round_metrics import fit_sts_from_rounds

    if name == "identity":  # the raw confidences: fitting only records their ECE
        import dspark

        return dspark.get_calibrator("identity", n_bins=opts.bins).fit(
            rounds.confidence_logits, rounds.accepted, rounds.verified)
    return fit_sts_from_rounds(rounds, objective=opts.objective, bias=name == "sts-bias", n_bins=opts.bins)


def simplest_within_margin(mean_ece: dict[str, float], names: tuple[str, ...],
                           margin: float = BIAS_MARGIN) -> str:
    """The first of ``names`` (ordered simplest first) whose mean held-out ECE is within ``margin``
    of the lowest: each fitted parameter must earn its place on the held-out half (the simpler
    calibrators also travel further: TensorRT-LLM reads STS temperatures, not per-position biases)."""
    best = min(mean_ece[n] for n in names)
    return next(n for n in names if mean_ece[n] <= best + margin)


def _nanmean(values: list[Any]) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else math.inf
