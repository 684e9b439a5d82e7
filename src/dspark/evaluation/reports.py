"""The reports ``dspark calibrate`` and ``dspark eval`` write: Markdown tables, the acceptance plot,
and the calibration summary printed on the terminal."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["CALIBRATOR_TITLES", "calibration_markdown", "eval_markdown", "plot_acceptance", "print_calibration"]

CALIBRATOR_TITLES = {"identity": "no calibration (raw)", "sts": "STS", "sts-bias": "STS + bias"}


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


def calibration_markdown(report: dict[str, Any], fitted: dict[str, Any], candidates: dict[str, dict[str, Any]],
                         mean_ece: dict[str, float], *, fit_prompts: int | None, test_prompts: int | None,
                         compared: bool, margin: float) -> str:
    """``calibration_report.md``: the raw confidences and every fitted calibrator (``fitted``, their
    held-out reports ``candidates`` and mean ECE) on the held-out rounds, the ECE noise floor and
    the one shipped. ``compared``: several calibrators competed within ``margin``."""
    label, bins, floor, chosen = report["drafter"], report["n_bins"], report["ece_noise_floor"], report["calibrator"]
    prompts_note = f" ({fit_prompts} prompts)" if fit_prompts else ""
    test_note = f" ({test_prompts} prompts)" if test_prompts else ""
    md = [f"# Calibration of {label}", "",
          f"Fitted on {report['fit_rounds']} rounds{prompts_note}; scored on {report['test_rounds']} held-out "
          f"rounds{test_note}. ECE: survival ECE with {bins} equal-width bins.", "",
          _report_table(report["overall"]["raw"], "before (raw)")]
    for n, c in fitted.items():
        params = "σ(z_j)" if n == "identity" else "T = " + ", ".join(f"{t:.3f}" for t in c.temperatures)
        if n == "sts-bias":
            params += "; b = " + ", ".join(f"{b:+.3f}" for b in c.biases)
        md += [_report_table(candidates[n]["overall"]["calibrated"],
                             f"after ({CALIBRATOR_TITLES[n]}; mean ECE {100 * mean_ece[n]:.2f} %)"), params, ""]
    md += ["ECE noise floor — what a perfectly calibrated predictor with the shipped predictions measures "
           "on these held-out rows (labels drawn from its own a_j, 32 seeded draws): "
           + ", ".join(_fmt(f, True) for f in floor) + ". An ECE near it is as calibrated as this many "
           "rounds can show.", "",
           f"Shipped: **{CALIBRATOR_TITLES[chosen]}**"
           + (f" (the simplest of raw < STS < STS + bias whose mean held-out ECE is within "
              f"{100 * margin:.1f} points of the lowest)" if compared else " (asked for)"), "",
           f"Command: `{report['command']}`", ""]
    return "\n".join(md)


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
