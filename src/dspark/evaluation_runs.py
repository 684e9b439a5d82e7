"""Calibrating and evaluating drafters on held-out prompts, with reports on disk: the library
functions behind ``dspark calibrate`` (:func:`calibrate`, a :class:`CalibrateOptions` in) and
``dspark eval`` (:func:`evaluate`, an :class:`EvalOptions` in), built on :mod:`dspark.evaluation`.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

from attrs import field, frozen

from dspark.options import (
    NamespaceOptions,
    at_least,
    existing_device,
    floats,
    one_of,
    optional_path,
    path,
    resolve_options,
    strings,
)

__all__ = [
    "CalibrateOptions", "CalibrateResult", "EvalOptions", "EvalResult", "calibrate", "calibration_split",
    "eval_markdown", "eval_prompts",
    "evaluate", "load_drafter_spec", "plot_acceptance", "print_calibration", "rounds_path",
]

THRESHOLDS = [round(0.05 * i, 2) for i in range(1, 20)]


def rounds_path(out: str | Path, label: str, temperature: float) -> Path:
    """Where ``dspark eval --out OUT`` keeps one drafter's rounds at one temperature."""
    return Path(out) / "rounds" / f"{label}-T{float(temperature)}.json"


def calibration_split(prompts: list[Any]) -> tuple[list[Any], list[Any]]:
    """``dspark calibrate``'s split of held-out prompts by their hash: (fit, test) — an even last
    hex digit of the key fits, an odd one scores."""
    return ([p for p in prompts if int(p.key[-1], 16) % 2 == 0],
            [p for p in prompts if int(p.key[-1], 16) % 2 == 1])


def eval_prompts(path: str | None, per_domain: int, skip: int = 0) -> list[Any]:
    """Held-out prompts (a ``dspark data`` eval_prompts.jsonl; default: the shipped ones), at most
    ``per_domain`` per domain in a stable order (by prompt hash), after the first ``skip`` of each
    domain — calibration skips the prompts evaluation uses, so the two never share a prompt."""
    from dspark.data.prompts import jsonl_prompts

    if path is None:
        from dspark.checkpoints import eval_prompts_path

        path = str(eval_prompts_path())
    prompts = list(jsonl_prompts(path))
    out, seen = [], {}
    for p in sorted(prompts, key=lambda p: p.key):
        k = seen.get(p.domain, 0)
        seen[p.domain] = k + 1
        if skip <= k < skip + per_domain:
            out.append(p)
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def files_digest_of_keys(prompts: list[Any]) -> str:
    """A digest of the selected prompts' keys (which prompts ran, whatever file they came from)."""
    import hashlib

    return hashlib.blake2b("\n".join(p.key for p in prompts).encode(), digest_size=16).hexdigest()


def load_drafter_spec(spec: str, target: Any) -> tuple[str, Any, Any]:
    """``LABEL=CHECKPOINT``, a checkpoint folder, a shipped drafter name, or ``ngram`` →
    (label, drafter, calibrator or None). A ``calibration.json`` next to the weights is loaded.
    ``CHECKPOINT:vocab=K`` is the variant cut to the K most frequent tokens (:mod:`dspark.drafters.prune`;
    default label ``NAME-vocabK``)."""
    import dspark
    from dspark.drafters.prune import parse_drafter_ref

    label = spec_label(spec)
    path, draft_vocab = parse_drafter_ref(_split_label(spec)[1])
    if path == "ngram":
        return label, dspark.get_drafter("ngram", vocab_size=target.vocab_size, gamma=7), None
    from dspark.checkpoints import resolve_checkpoint

    folder = resolve_checkpoint(path)
    from dspark.drafters.checkpoint import from_pretrained

    drafter = from_pretrained(folder, target, draft_vocab=draft_vocab)
    return label, drafter, calibrator_beside(folder, drafter.confidence_model)


def folder_calibrator(folder: Any, draft_vocab: int | None = None) -> Any:
    """The calibrator for the confidence logits the engine reads from a checkpoint folder's drafter
    (its confidence model as :func:`~dspark.drafters.checkpoint.folder_confidence_model` gives it):
    :func:`calibrator_beside` it."""
    from dspark.drafters.checkpoint import folder_confidence_model

    return calibrator_beside(folder, folder_confidence_model(folder, draft_vocab))


def calibrator_beside(folder: Any, confidence_model: Any) -> Any:
    """None when ``confidence_model`` (the folder's drafter's) is calibrated itself (``stacked``),
    else the folder's ``calibration.json`` (fitted on the confidence head's logits), else None."""
    from dspark.calibration import load_calibrator

    if getattr(confidence_model, "calibrated", False):
        return None
    cal = Path(folder) / "calibration.json"
    return load_calibrator(cal) if cal.is_file() else None


def calibration_label(calibrator: Any, confidence_model: Any) -> str | None:
    """What calibrates the engine's confidences, for reports: the folder's calibration.json, a
    confidence.json calibrated itself, or None (raw)."""
    if calibrator is not None:
        return f"{calibrator.name} (calibration.json)"
    return f"{confidence_model.name} (confidence.json)" if getattr(confidence_model, "calibrated", False) else None


def _split_label(spec: str) -> tuple[str, str]:
    """``LABEL=REF`` → (LABEL, REF); a spec without a label → ("", spec). The '=' of a bare
    ``NAME:vocab=K`` is not a label's."""
    label, sep, ref = spec.partition("=")
    return (label, ref) if sep and not label.endswith(":vocab") else ("", spec)


_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def spec_label(spec: str) -> str:
    """The label of a drafter spec: ``LABEL`` of ``LABEL=REF``, else the checkpoint folder's name
    (``NAME-vocabK`` for a ``:vocab=K`` variant). It names files under the output folder, so it
    must be one plain file name (letters, digits, ``. _ + -``); anything else is a ValueError."""
    from dspark.drafters.prune import parse_drafter_ref, variant_label

    label, ref = _split_label(spec)
    path, draft_vocab = parse_drafter_ref(ref)
    if not label:
        p = Path(path)
        label = variant_label((p.parent.name if p.name == "checkpoint" else p.name) or path, draft_vocab)
    if not _LABEL.fullmatch(label):
        raise ValueError(f"drafter label {label!r} (from {spec!r}) is not a plain file name: use letters, digits "
                         "and . _ + - (LABEL=CHECKPOINT sets one)")
    return label


def _spec_path(spec: str) -> str:
    """The checkpoint of a ``LABEL=CHECKPOINT[:vocab=K]`` spec (or the spec itself)."""
    from dspark.drafters.prune import parse_drafter_ref

    return parse_drafter_ref(_split_label(spec)[1])[0]


def _check_drafter_spec(spec: str) -> str:
    """What :func:`load_drafter_spec` would refuse without a target (a checkpoint that is not
    there, a label that is not a file name) → the digest of the checkpoint's files."""
    from dspark.checkpoints import resolve_checkpoint
    from dspark.provenance import files_digest

    spec_label(spec)
    if _spec_path(spec) == "ngram":
        return "ngram"
    return files_digest(resolve_checkpoint(_spec_path(spec)))


def _sampling(temperature: float) -> Any:
    from dspark.types import SamplingParams

    return SamplingParams.greedy() if temperature == 0 else SamplingParams.random(temperature)


def _target(model: str, dtype: str, device: str = "cpu") -> Any:
    import torch

    from dspark.targets import load_target

    return load_target(model, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype], device=device)


def _drafters(_inst: Any, a: Any, v: tuple[str, ...]) -> None:
    if not v or not all(isinstance(x, str) and x.strip() for x in v):
        raise ValueError(f"{a.name} must name at least one drafter (LABEL=CHECKPOINT, a folder, a shipped "
                         f"name or ngram), got {v!r}")


def _temperatures(_inst: Any, a: Any, v: tuple[float, ...]) -> None:
    if not v or any(t < 0 for t in v):
        raise ValueError(f"{a.name} must be one or more numbers ≥ 0, got {v!r}")


_CAL_TITLES = {"identity": "no calibration (raw)", "sts": "STS", "sts-bias": "STS + bias"}
CALIBRATORS = ("identity", "sts", "sts-bias")
"""What ``calibrator="best"`` fits and compares, simplest first."""
BIAS_MARGIN = 0.001
"""Mean held-out ECE by which a calibrator must beat every simpler one to be shipped (0.1 points)."""


@frozen
class CalibrateOptions(NamespaceOptions):
    """What ``dspark calibrate`` fits (defaults: the command line's; docs/cli.md explains each).
    ``checkpoint`` (a checkpoint folder or a shipped drafter's name) has no default."""

    checkpoint: str = field(converter=path)
    out: str | None = field(default=None, converter=optional_path)
    temperature: float = field(default=0.0, validator=at_least(0, integer=False))
    objective: str = field(default="ece", validator=one_of("ece", "brier"))
    calibrator: str = field(default="best", validator=one_of("best", *CALIBRATORS))
    bins: int = field(default=20, validator=at_least(1))
    reuse_rounds: bool = False
    skip: int = field(default=12, validator=at_least(0))
    prompts: str | None = field(default=None, converter=optional_path)
    per_domain: int = field(default=40, validator=at_least(1))
    max_new_tokens: int = field(default=96, validator=at_least(1))
    concurrency: int = field(default=16, validator=at_least(1))
    model: str = field(default="smollm2-135m", converter=path)
    dtype: str = field(default="float32", validator=one_of("float32", "bfloat16"))
    device: str = field(default="cpu", validator=existing_device)
    seed: int = 0
    quiet: bool = False


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


@frozen
class EvalOptions(NamespaceOptions):
    """What ``dspark eval`` measures (defaults: the command line's; docs/cli.md explains each).
    ``drafters`` (``--drafter``, repeatable) has no default; ``temperatures`` is ``--temperature``."""

    _CLI_NAMES = {"drafters": "drafter", "temperatures": "temperature"}

    drafters: tuple[str, ...] = field(converter=strings, validator=_drafters)
    temperatures: tuple[float, ...] = field(default=(0.0,), converter=floats, validator=_temperatures)
    out: str = field(default="out/eval", converter=path)
    fresh: bool = False
    prompts: str | None = field(default=None, converter=optional_path)
    per_domain: int = field(default=12, validator=at_least(1))
    max_new_tokens: int = field(default=96, validator=at_least(1))
    concurrency: int = field(default=8, validator=at_least(1))
    model: str = field(default="smollm2-135m", converter=path)
    dtype: str = field(default="float32", validator=one_of("float32", "bfloat16"))
    device: str = field(default="cpu", validator=existing_device)
    seed: int = 0
    quiet: bool = False


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
    from dspark.evaluation import (
        Rounds,
        collect_rounds,
        evaluate_rounds,
        save_json,
    )
    from dspark.metrics import ece_noise_floor, survival_labels, verified_mask
    from dspark.plotting import reliability_diagram

    opts = resolve_options(CalibrateOptions, options, overrides)
    _check_drafter_spec(opts.checkpoint)  # a missing checkpoint or prompt file fails before the model loads
    if not opts.out and parse_drafter_ref(_split_label(opts.checkpoint)[1])[1] is not None:
        raise ValueError(f"{opts.checkpoint}: a ':vocab=K' variant shares its folder with the full drafter; "
                         "give --out so its calibration does not replace the folder's calibration.json")
    out = Path(opts.out) if opts.out else resolve_checkpoint(_spec_path(opts.checkpoint))
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
        target = _target(opts.model, opts.dtype, opts.device)
        label, drafter, _ = load_drafter_spec(opts.checkpoint, target)
        # fit on half of the held-out prompts, report on the other half (split by prompt hash)
        fit_p, test_p = calibration_split(prompts)
        sampling = _sampling(opts.temperature)
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
    ov = report["overall"]
    prompts_note = f" ({n_fit_p} prompts)" if n_fit_p else ""
    test_note = f" ({n_test_p} prompts)" if n_test_p else ""
    md = [f"# Calibration of {label}", "",
          f"Fitted on {len(fit_r.domain)} rounds{prompts_note}; scored on {len(test_r.domain)} held-out "
          f"rounds{test_note}. ECE: survival ECE with {opts.bins} equal-width bins.", "",
          _report_table(ov["raw"], "before (raw)")]
    for n, c in fitted.items():
        params = "σ(z_j)" if n == "identity" else "T = " + ", ".join(f"{t:.3f}" for t in c.temperatures)
        if n == "sts-bias":
            params += "; b = " + ", ".join(f"{b:+.3f}" for b in c.biases)
        md += [_report_table(reports[n]["overall"]["calibrated"],
                             f"after ({_CAL_TITLES[n]}; mean ECE {100 * mean_ece[n]:.2f} %)"), params, ""]
    md += ["ECE noise floor — what a perfectly calibrated predictor with the shipped predictions measures "
           "on these held-out rows (labels drawn from its own a_j, 32 seeded draws): "
           + ", ".join(_fmt(f, True) for f in floor) + ". An ECE near it is as calibrated as this many "
           "rounds can show.", "",
           f"Shipped: **{_CAL_TITLES[chosen]}**"
           + (f" (the simplest of raw < STS < STS + bias whose mean held-out ECE is within "
              f"{100 * BIAS_MARGIN:.1f} points of the lowest)" if len(names) > 1 else " (asked for)"), "",
           f"Command: `{report['command']}`", ""]
    (out / "calibration_report.md").write_text("\n".join(md))
    curves = {"raw": (torch.cumprod(torch.sigmoid(z), 1), y, mask)}
    curves.update({n: (a, y, mask) for n, a in survival.items() if n != "identity"})  # identity is raw
    reliability_diagram(curves, out / "reliability.png", title=f"{label}: prefix survival, held-out rounds")
    return CalibrateResult(out, cal, report)


def _fit_candidate(name: str, rounds: Any, opts: CalibrateOptions) -> Any:
    from dspark.evaluation import fit_sts_from_rounds

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


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{100 * v:.2f} %" if pct else f"{v:.3f}"


def _report_table(rep: dict[str, Any], title: str) -> str:
    lines = [f"**{title}**", "", "| j | n | ECE | AUROC | Brier | mean a_j | observed survival | cumprod bias |",
             "|---|---|---|---|---|---|---|---|"]
    for j in range(rep["gamma"]):
        lines.append(f"| {j + 1} | {rep['count'][j]} | {_fmt(rep['ece'][j], True)} | {_fmt(rep['auroc'][j])} | "
                     f"{_fmt(rep['brier'][j])} | {_fmt(rep['mean_predicted'][j])} | {_fmt(rep['observed'][j])} | "
                     f"{_fmt(rep['cumprod_bias'][j])} |")
    return "\n".join(lines) + "\n"


def print_calibration(report: dict[str, Any]) -> None:
    """ECE and AUROC per position, raw and calibrated (a :class:`CalibrateResult`'s report)."""
    ov = report["overall"]
    rows = [("raw", ov.get("raw"))]
    cands = report.get("candidates") or {}
    if cands:  # every calibrator fitted, the shipped one marked
        rows += [(("* " if n == report.get("calibrator") else "") + n, c["calibrated"]) for n, c in cands.items()]
    else:
        rows.append(("calibrated", ov.get("calibrated")))
    for name, r in rows:
        if r:
            print(f"{name:>10}: ECE per position " + " ".join(_fmt(e, True) for e in r["ece"])
                  + " | AUROC " + " ".join(_fmt(a) for a in r["auroc"]))


def evaluate(options: EvalOptions | None = None, /, **overrides: Any) -> EvalResult:
    """Evaluate drafters per domain at each temperature on held-out prompts (every draft position
    verified): τ, proposal length, conditional acceptance and prefix survival per position,
    threshold sweep, confidence metrics; writes ``eval.json``, ``eval.md``, ``acceptance.png`` and
    the rounds (reused by a re-run unless ``fresh``) to ``options.out``. ``overrides`` replace
    fields of ``options`` (or give all of them: ``drafters=[...]``, ...)."""
    from dspark.evaluation import Rounds, collect_rounds, evaluate_rounds, save_json
    from dspark.provenance import check, files_digest, record

    opts = resolve_options(EvalOptions, options, overrides)
    # a missing checkpoint or prompt file, a bad or repeated label: refused before the model loads
    digests = {spec: _check_drafter_spec(spec) for spec in opts.drafters}
    labels = [spec_label(spec) for spec in opts.drafters]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ValueError(f"drafter label {repeated[0]!r} is given twice; name each with LABEL=CHECKPOINT")
    prompts = eval_prompts(opts.prompts, opts.per_domain)
    prompt_file = opts.prompts or "shipped"
    base = {"model": opts.model, "dtype": opts.dtype, "device": opts.device, "prompts": prompt_file,
            "prompts_digest": files_digest(opts.prompts) if opts.prompts else "shipped",
            "prompt_keys": files_digest_of_keys(prompts), "max_new_tokens": opts.max_new_tokens,
            "concurrency": opts.concurrency, "seed": opts.seed}
    target = _target(opts.model, opts.dtype, opts.device)
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
                rounds = collect_rounds(target, drafter, prompts, _sampling(temp), max_new_tokens=opts.max_new_tokens,
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


def eval_markdown(results: dict[str, Any]) -> str:
    runs = results["runs"]
    domains = sorted({d for r in runs.values() for d in r["domains"]})
    lines = ["# Drafter evaluation", "", f"{results['prompts']} held-out prompts, up to "
             f"{results['max_new_tokens']} new tokens each, target {results['model']} ({results['dtype']}); "
             "every valid draft position verified (`full`).", "",
             "## τ (mean committed tokens per round)", "",
             "| drafter | T | " + " | ".join(domains) + " | overall | mean proposal | rounds |",
             "|---|---|" + "---|" * (len(domains) + 3)]
    for r in runs.values():
        lines.append(f"| {r['drafter']} | {r['temperature']} | "
                     + " | ".join(_fmt(r["domains"][d]["tau"]) if d in r["domains"] else "–" for d in domains)
                     + f" | **{_fmt(r['overall']['tau'])}** | {_fmt(r['overall']['mean_proposed'])} | {r['overall']['rounds']} |")
    lines += ["", "## Conditional acceptance per position (P(j accepted | < j accepted))", ""]
    gamma = max(len(r["overall"]["raw"]["conditional_acceptance"]) for r in runs.values())
    lines += ["| drafter | T | " + " | ".join(f"j={j}" for j in range(1, gamma + 1)) + " |", "|---|---|" + "---|" * gamma]
    for r in runs.values():
        ca = r["overall"]["raw"]["conditional_acceptance"]
        lines.append(f"| {r['drafter']} | {r['temperature']} | " + " | ".join(_fmt(v) for v in ca) + " |")
    lines += ["", "## Prefix survival per position (P(accepted ≥ j), the reference's accept_rate@(j−1))", ""]
    lines += ["| drafter | T | " + " | ".join(f"j={j}" for j in range(1, gamma + 1)) + " |", "|---|---|" + "---|" * gamma]
    for r in runs.values():
        ps = r["overall"]["raw"]["prefix_survival"]
        lines.append(f"| {r['drafter']} | {r['temperature']} | " + " | ".join(_fmt(v) for v in ps) + " |")
    lines += ["", "## Confidence quality (overall; calibrated where a calibration.json exists)", "",
              "| drafter | T | ECE per position | AUROC per position |", "|---|---|---|---|"]
    for r in runs.values():
        rep = r["overall"].get("calibrated") or r["overall"]["raw"]
        lines.append(f"| {r['drafter']} | {r['temperature']} | " + " ".join(_fmt(e, True) for e in rep["ece"])
                     + " | " + " ".join(_fmt(a) for a in rep["auroc"]) + " |")
    lines += ["", "## Threshold sweep (survival threshold θ on calibrated a_j)", ""]
    for r in runs.values():
        sw = r["overall"].get("threshold_sweep") or []
        lines += [f"**{r['drafter']} T={r['temperature']}**", "",
                  "| θ | verified | accepted | rejected verified | mean ℓ | τ |", "|---|---|---|---|---|---|"]
        for s in sw[::2]:
            lines.append(f"| {s['threshold']:.2f} | {s['verified']} | {s['accepted']} | {s['rejected_verified']} | "
                         f"{s['mean_verified']:.2f} | {s['tau']:.3f} |")
        lines.append("")
    lines += [f"Command: `{results['command']}`", ""]
    return "\n".join(lines)


def plot_acceptance(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    temps = sorted({r["temperature"] for r in results["runs"].values()})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for r in results["runs"].values():
            if r["temperature"] != t:
                continue
            ca = [math.nan if v is None else v for v in r["overall"]["raw"]["conditional_acceptance"]]
            ax.plot(range(1, len(ca) + 1), ca, marker="o", ms=3, label=f"{r['drafter']} (τ {r['overall']['tau']:.2f})")
        ax.set(xlabel="draft position j", ylabel="P(j accepted | < j accepted)", ylim=(0, 1),
               title=f"conditional acceptance, T = {t}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
