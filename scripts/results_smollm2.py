"""Write a trained-drafters report (docs/reports/trained-drafters.md; date it and list it in
docs/reports/README.md) from the outputs of scripts/train_smollm2.sh, dspark eval and dspark demo.

    python scripts/results_smollm2.py --runs runs --eval runs/eval --demo out/demo

Copies the figures it cites into docs/reports/figures/ (acceptance per position, reliability diagrams,
training curves) and every number it prints comes from those JSON files.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

DRAFTERS = ["dspark-gated", "dspark-vanilla", "dspark-rnn", "dflash", "eagle3", "dspark-gated-long"]


def fmt(v, pct=False, digits=3):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{100 * v:.1f} %" if pct else f"{v:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--eval", default="runs/eval")
    ap.add_argument("--demo", default="out/demo")
    ap.add_argument("--docs", default="docs/reports")
    ap.add_argument("--cpu-demo", action="append", default=[],
                    help="a dspark demo folder per kind of CPU (repeatable): the speed-by-CPU table")
    a = ap.parse_args()
    runs, ev, docs = Path(a.runs), Path(a.eval), Path(a.docs)
    figs = docs / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    results = json.loads((ev / "eval.json").read_text())
    out = ["# Results: trained drafters for SmolLM2-135M-Instruct on a 2-core CPU", ""]
    if a.cpu_demo:  # the same table scripts/speed_by_cpu.py prints
        import sys

        sys.path.insert(0, str(Path(__file__).parent))
        from speed_by_cpu import markdown, plot, rows

        table = rows([Path(d) for d in a.cpu_demo])
        plot(table, figs / "speed_by_cpu.png")
        out += ["## Speed-up by kind of CPU", "", *markdown(table), "",
                "![speed-up by kind of CPU](figures/speed_by_cpu.png)", ""]

    # -- training settings --------------------------------------------------------------------
    out += ["## Training (same data, same batches, same number of steps for every drafter; "
            "`dspark-gated-long` is dspark-gated continued to 3× the steps, outside the comparison)", "",
            "| drafter | head | rank | steps | global batch | anchors/seq | draft vocab | layers | γ | analytic τ (last 100 steps) | wall-clock |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    commands = []
    for name in DRAFTERS:
        t = runs / name / "train.json"
        if not t.is_file():
            continue
        tr = json.loads(t.read_text())
        d, c = tr["drafter"], tr["train"]
        log = runs / name / "log.jsonl"
        if log.is_file():  # the mean of the last 100 steps: one batch's value is noisy
            last = [json.loads(x)["tau"] for x in log.read_text().splitlines()[-100:]]
            tr["final"]["tau"] = sum(last) / len(last)
        out.append(f"| {name} | {d.get('head') or '–'} | {d['rank'] if d.get('head') else '–'} | {c['steps']} | "
                   f"{c['seqs_per_step']} seqs | {c['anchors_per_seq']} | {(d.get('draft_vocab_size') or 1) - 1} | "
                   f"{d['num_layers'] if d['kind'] != 'eagle3' else 1} | {d['gamma']} | {fmt(tr['final']['tau'], digits=2)} | "
                   f"{tr['seconds_total'] / 60:.1f} min |")
        commands.append(f"dspark {tr['command'].split('dspark ', 1)[-1]}" if "dspark" in tr["command"] else tr["command"])
        curve = runs / name / "curve.png"
        if curve.is_file():
            shutil.copy(curve, figs / f"train_curve_{name}.png")
    first = json.loads((runs / DRAFTERS[0] / "train.json").read_text()) if (runs / DRAFTERS[0] / "train.json").is_file() else None
    if first:
        out += ["", f"Data: {first['sequences']} self-distilled sequences ({first['tokens']} tokens, prompt + "
                "response) written by the target with `dspark data` (T = 0.7, top-p 0.95, ≤ 128 new tokens; "
                "math, code and chat prompts; 10 % of prompts held out by hash). Loss per DESIGN.md §3 for "
                f"each kind; AdamW, lr {first['train']['lr']}, warmup 4 % + cosine, clip 1.0, bf16 autocast, "
                f"{first['threads']} thread(s) per run. Draft layers initialised from the target's top layer.", ""]
    out += ["Wall-clock times are with two training queues (1 thread each) and a third run sharing the 2 "
            "cores; the analytic τ is the teacher-forced 1 + Σ_k Π_{j≤k} ᾱ_j at T = 1 on training batches.", "",
            "Commands (one per drafter, as recorded in each run's train.json; `RUNS=runs bash "
            "scripts/train_smollm2.sh` runs the same sequence from scratch, data included):", "", "```bash"] + commands + ["```", ""]

    # -- τ table --------------------------------------------------------------------------------
    for temp in sorted({r["temperature"] for r in results["runs"].values()}):
        rows = {r["drafter"]: r for r in results["runs"].values() if r["temperature"] == temp}
        domains = sorted({d for r in rows.values() for d in r["domains"]})
        out += [f"## τ per domain (T = {temp}, every valid position verified)", "",
                "| drafter | " + " | ".join(domains) + " | average | vs DFlash | vs Eagle3 |",
                "|---|" + "---|" * (len(domains) + 3)]
        base_f = rows.get("dflash", {}).get("overall", {}).get("tau")
        base_e = rows.get("eagle3", {}).get("overall", {}).get("tau")
        for name, r in rows.items():
            tau = r["overall"]["tau"]
            out.append(f"| {name} | " + " | ".join(fmt(r["domains"].get(d, {}).get("tau")) for d in domains)
                       + f" | **{fmt(tau)}** | {fmt(tau / base_f, digits=2) + '×' if base_f else '–'} | "
                       f"{fmt(tau / base_e, digits=2) + '×' if base_e else '–'} |")
        out.append("")
    shutil.copy(ev / "acceptance.png", figs / "results_acceptance.png")
    shutil.copy(ev / "eval.md", docs / "results_eval.md")
    out += ["![conditional acceptance per position](figures/results_acceptance.png)", "",
            "Conditional acceptance P(position j accepted | positions < j accepted) per drafter "
            "(paper Fig. 2). Prefix survival, confidence metrics and the threshold sweeps per drafter: "
            "[results_eval.md](results_eval.md) (the `dspark eval` report).", ""]
    g0 = {r["drafter"]: r["overall"]["tau"] for r in results["runs"].values() if r["temperature"] == 0.0}
    if all(k in g0 for k in ("dspark-gated", "dspark-vanilla", "dspark-rnn", "dflash", "eagle3")):
        ds = (g0["dspark-gated"] + g0["dspark-vanilla"] + g0["dspark-rnn"]) / 3
        summary = (f"Greedy, equal budget: DSpark (mean of the three heads) τ {ds:.3f} = "
                   f"**{ds / g0['dflash']:.2f}× DFlash** (paper target ≥ 1.16×) and **{ds / g0['eagle3']:.2f}× "
                   f"Eagle3** (paper target ≥ 1.27×).")
        out += [summary, ""]

    # -- calibration ------------------------------------------------------------------------------
    out += ["## Calibration (STS fitted on half of the held-out prompts, scored on the other half)", "",
            "| drafter | confidence | ECE before (per position) | ECE after (per position) | max ECE after | AUROC after (per position) |",
            "|---|---|---|---|---|---|"]
    for name in DRAFTERS:
        f = runs / name / "checkpoint" / "calibration_report.json"
        if not f.is_file():
            continue
        rep = json.loads(f.read_text())["overall"]
        raw, cal = rep["raw"], rep["calibrated"]
        conf = "confidence head" if name.startswith("dspark") else "max-prob proxy"
        eces = [e for e in cal["ece"] if e is not None]
        out.append(f"| {name} | {conf} | " + " ".join(fmt(e, True) for e in raw["ece"]) + " | "
                   + " ".join(fmt(e, True) for e in cal["ece"]) + f" | {fmt(max(eces) if eces else None, True)} | "
                   + " ".join(fmt(x, digits=2) for x in cal["auroc"]) + " |")
        rel = runs / name / "checkpoint" / "reliability.png"
        if rel.is_file():
            shutil.copy(rel, figs / f"reliability_{name}.png")
    out += ["", "![reliability, dspark-gated](figures/reliability_dspark-gated.png)", ""]

    # -- demo -----------------------------------------------------------------------------------
    demo = Path(a.demo) / "demo.json"
    if demo.is_file():
        d = json.loads(demo.read_text())
        sp = d["speed"]
        out += ["## Wall-clock speed-up (the README main job)", "",
                f"`{d['command']}`: **{sp['speedup_vs_best_plain']:.2f}×** over the best plain decode "
                f"({sp['baseline']}), bf16, concurrency 1, {sp['prompts']} held-out prompts × {sp['repeats']} "
                f"repeats, mean τ {sp['mean_tau']:.2f}. Median seconds per repeat: "
                + ", ".join(f"{k} {v:.2f}" for k, v in sp["median_seconds"].items()) + ".", ""]
    out += [f"Evaluation command: `{results['command']}`", "",
            "Regenerate this page: `python scripts/results_smollm2.py --runs runs --eval runs/eval --demo out/demo`.", ""]
    (docs / "trained-drafters.md").write_text("\n".join(out))
    print(f"wrote {docs / 'trained-drafters.md'}")


if __name__ == "__main__":
    main()
