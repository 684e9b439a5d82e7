"""Tables and a figure from what scripts/cuda_serving.sh measured on a GPU: the verification profile
and each recorded bench run on its own (repeat by repeat, since a cut-off bench writes no bench.json).

    python scripts/cuda_report.py PROFILE_JSON BENCH_RUNS_DIR OUT_PREFIX [--gate-prior JSON]

writes OUT_PREFIX.json (the per-run summaries, the profile's step times) and OUT_PREFIX.png (step
time against R at each width and context); prints the Markdown tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.bench.records import LevelRun, summarise_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("runs")
    ap.add_argument("out")
    ap.add_argument("--gate-prior")
    a = ap.parse_args()
    shapes = json.loads(Path(a.profile).with_suffix(".shapes.json").read_text())
    device = json.loads(Path(a.profile).read_text()).get("device", "?")
    runs = []
    for f in sorted(Path(a.runs).glob("r*-c*.json")):
        s = summarise_run(LevelRun.from_dict(json.loads(f.read_text())))
        runs.append({"file": f.name, "repeat": int(f.name.split("-")[0][1:]), **s})
    runs.sort(key=lambda r: (r["concurrency"], r["repeat"], r["scheduler"]))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": device, "profile_shapes": shapes, "runs": runs}
    if a.gate_prior:
        record["gate_prior"] = json.loads(Path(a.gate_prior).read_text())
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")

    contexts = sorted({s["context"] for s in shapes})
    widths = sorted({s["tokens_per_request"] for s in shapes})
    requests = sorted({s["requests"] for s in shapes})
    ms = {(s["context"], s["requests"], s["tokens_per_request"]): 1e3 * s["step_seconds"] for s in shapes}
    print(f"Verification step (ms), {device}:\n")
    print("| context | R | " + " | ".join(f"1+ℓ = {w}" for w in widths) + " |")
    print("|---|---|" + "---|" * len(widths))
    for c in contexts:
        for r in requests:
            print(f"| {c} | {r} | " + " | ".join(f"{ms[c, r, w]:.1f}" for w in widths) + " |")
    print("\nBench runs, one row per recorded run:\n")
    print("| c | repeat | scheduler | tok/s | τ | drafted | step ms | draft ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['concurrency']} | {r['repeat']} | {r['scheduler']} | {r['throughput_tok_s']:.1f} | {r['tau']:.2f} "
              f"| {r['drafted_fraction']:.2f} | {r['step_ms']:.1f} | {r['draft_ms']:.1f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.6), sharey=True, squeeze=False)
    for ax, c in zip(axes[0], contexts):
        for w in widths:
            ax.plot(requests, [ms[c, r, w] for r in requests], marker="o", label=f"1+ℓ = {w}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{c}-token context")
        ax.set_xlabel("requests R")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("verification step (ms)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M bf16 verification step, {device} (dspark profile --device cuda)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
