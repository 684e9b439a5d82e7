"""Synthetic calibration experiment: raw vs temperature vs sequential temperature scaling (STS)
vs STS + per-position bias.

Simulates verification rounds whose raw confidence logits are over-confident by a known amount
(``dspark.calibration.synthetic_rounds``: z = slope · logit(c*) + bias), fits each calibrator on
one half and scores prefix survival on the other half. Writes

* ``<out>/calibration_synthetic.json`` — config, fitted calibrators, per-position reports,
* ``<out>/calibration_reliability.png`` — reliability diagram per position (held-out half),
* ``<markdown>`` — before/after tables, headed by the exact command that produced them.

Run from the repository root:  python scripts/calibration_figures.py --out docs/figures
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

import torch

from dspark.calibration import (
    IdentityCalibrator,
    STSBiasCalibrator,
    STSCalibrator,
    TemperatureCalibrator,
    synthetic_rounds,
)
from dspark.confidence_report import ConfidenceReport, confidence_report
from dspark.metrics import survival_labels
from dspark.plotting import reliability_diagram

SWEEP_BIASES = (0.0, 0.2, 0.5, 1.0)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/figures"), help="JSON + PNG folder")
    p.add_argument("--markdown", type=Path, default=Path("out/calibration_synthetic.md"),
                   help="the before/after report (docs/scheduling-and-calibration.md quotes it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=40_000, help="rounds; half fit, half evaluation")
    p.add_argument("--gamma", type=int, default=7, help="draft block size γ")
    p.add_argument("--slope", type=float, default=2.0, help="over-confidence factor k")
    p.add_argument("--bias", type=float, default=0.2, help="logit offset of the raw head")
    p.add_argument("--n-bins", type=int, default=15, help="equal-width ECE bins")
    return p.parse_args()


def _command(args: argparse.Namespace) -> str:
    parts = ["python", "scripts/calibration_figures.py"]
    for flag, value in [
        ("--out", args.out),
        ("--markdown", args.markdown),
        ("--seed", args.seed),
        ("--n", args.n),
        ("--gamma", args.gamma),
        ("--slope", args.slope),
        ("--bias", args.bias),
        ("--n-bins", args.n_bins),
    ]:
        parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


def _experiment(args: argparse.Namespace, bias: float) -> tuple[dict, dict, object]:
    """Fit the four calibrators on the first half; report on the second half."""
    gen = torch.Generator().manual_seed(args.seed)
    data = synthetic_rounds(args.n, args.gamma, slope=args.slope, bias=bias, generator=gen)
    half = args.n // 2
    fit, ev = data.take(slice(0, half)), data.take(slice(half, None))
    calibrators = {
        "raw": IdentityCalibrator(n_bins=args.n_bins),
        "temperature": TemperatureCalibrator(n_bins=args.n_bins),
        "sts": STSCalibrator(n_bins=args.n_bins),
        "sts-bias": STSBiasCalibrator(n_bins=args.n_bins),
    }
    fitted = {k: c.fit(fit.logits, fit.accepted) for k, c in calibrators.items()}
    reports = {
        k: confidence_report(c.calibrate(ev.logits), ev.accepted, n_bins=args.n_bins)
        for k, c in fitted.items()
    }
    return fitted, reports, ev


def _f(v: float, fmt: str) -> str:
    return "–" if v != v else format(v, fmt)


def _before_after(before: ConfidenceReport, after: ConfidenceReport) -> str:
    head = (
        "| j | ECE before | ECE after | AUROC before | AUROC after | Brier before | Brier after "
        "| mean pred before | mean pred after | observed survival | cumprod bias before "
        "| cumprod bias after |"
    )
    lines = [head, "|" + "---|" * 12]
    for k in range(before.gamma):
        cells = [
            str(k + 1),
            _f(100 * before.ece[k], ".2f") + " %",
            _f(100 * after.ece[k], ".2f") + " %",
            _f(before.auroc[k], ".4f"),
            _f(after.auroc[k], ".4f"),
            _f(before.brier[k], ".4f"),
            _f(after.brier[k], ".4f"),
            _f(before.mean_predicted[k], ".4f"),
            _f(after.mean_predicted[k], ".4f"),
            _f(before.observed[k], ".4f"),
            _f(before.cumprod_bias[k], "+.4f"),
            _f(after.cumprod_bias[k], "+.4f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = _parse()
    command = _command(args)
    fitted, reports, ev = _experiment(args, args.bias)

    sweep = []
    for bias in SWEEP_BIASES:
        _, rep, _ = _experiment(args, bias)
        sweep.append({"bias": bias, **{k: max(r.ece) for k, r in rep.items()}})

    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "calibration_reliability.png"
    labels, _ = survival_labels(ev.accepted, args.gamma)  # [N, γ]
    reliability_diagram(
        {k: (torch.cumprod(c.calibrate(ev.logits), dim=1), labels) for k, c in fitted.items()},
        png,
        n_bins=args.n_bins,
        title=f"Prefix survival reliability, held-out half (k={args.slope}, bias={args.bias})",
    )

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {
        "command": command,
        "config": config,
        "calibrators": {k: c.to_dict() for k, c in fitted.items()},
        "reports": {k: r.to_dict() for k, r in reports.items()},
        "bias_sweep_max_ece": sweep,
    }
    (args.out / "calibration_synthetic.json").write_text(
        json.dumps(result, indent=2, allow_nan=False) + "\n"
    )

    sts = fitted["sts"]
    rel_png = Path(os.path.relpath(png, args.markdown.parent)).as_posix()
    md = [
        "# Confidence calibration on synthetic rounds",
        "",
        "Produced by (from the repository root):",
        "",
        "```",
        command,
        "```",
        "",
        f"{args.n} simulated verification rounds, γ = {args.gamma}. True per-step acceptance "
        "c*_j = σ(l_j) with l_j = 2 − 0.35 (j − 1) + u + 0.75 ε_j (u: per-round difficulty, "
        f"ε_j: per-position noise); the prefix breaks at the first failure. The raw head reports "
        f"z_j = {args.slope} · l_j + {args.bias} (over-confident). Calibrators are fitted on the "
        f"first {args.n // 2} rounds and scored on the other {args.n - args.n // 2}. Survival "
        "columns score a_j = Π_{i≤j} c_i against [accepted ≥ j]; ECE uses "
        f"{args.n_bins} equal-width bins. Terms: `dspark.metrics`.",
        "",
        f"Fitted STS temperatures T_1..T_{args.gamma}: "
        + ", ".join(f"{t:.3f}" for t in sts.temperatures)
        + f"; single temperature: {fitted['temperature'].temperature:.3f}. STS + bias (T_j, b_j): "
        + ", ".join(f"({t:.3f}, {b:+.3f})" for t, b in zip(fitted["sts-bias"].temperatures, fitted["sts-bias"].biases))
        + f" (exact: ({args.slope}, {-args.bias / args.slope:+.3f})).",
        "",
        "## Before (raw σ(z)) vs after (STS), held-out half",
        "",
        _before_after(reports["raw"], reports["sts"]),
        "## Full reports",
        "",
        "`observed survival` equals the reference's `accept_rate@(j−1)`; `cond. accept` is the "
        "paper's position-wise conditional acceptance P(j accepted | < j accepted), compared with "
        "the mean calibrated c_j over the same at-risk rounds.",
        "",
    ]
    for k, r in reports.items():
        md += [r.to_markdown(title=k)]
    md += [
        "## Logit offset: what temperature scaling cannot fix",
        "",
        "Worst per-position held-out survival ECE as the raw head's logit offset grows "
        f"(same seed, k = {args.slope}). A temperature rescales logits but cannot shift them, so "
        "an offset leaves a residual error that STS only partly absorbs through T_j; STS + bias "
        "fits the shift too (c_j = σ(z_j / T_j + b_j); exact at T_j = k, b_j = −bias / k).",
        "",
        "| bias | raw | temperature | sts | sts-bias |",
        "|---|---|---|---|---|",
    ]
    for row in sweep:
        md.append(
            f"| {row['bias']:.1f} | {100 * row['raw']:.2f} % | {100 * row['temperature']:.2f} % | "
            f"{100 * row['sts']:.2f} % | {100 * row['sts-bias']:.2f} % |"
        )
    md += ["", "## Reliability diagram (held-out half)", "", f"![reliability]({rel_png})", ""]
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text("\n".join(md))
    print(f"wrote {args.out / 'calibration_synthetic.json'}, {png}, {args.markdown}")
    print("held-out survival ECE raw:", ", ".join(f"{100 * e:.2f}%" for e in reports["raw"].ece))
    print("held-out survival ECE sts:", ", ".join(f"{100 * e:.2f}%" for e in reports["sts"].ece))


if __name__ == "__main__":
    main()
