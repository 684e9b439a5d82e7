"""Which confidence ranks and calibrates a drafter's rounds best: its confidence head, the max-prob
proxy, or a stack of features of the draft block?

Issue 12 asks for AUROC ≥ 0.8 and ECE ≤ 1.5 % (20 bins) at every position. This script decodes the
prompts once (greedy, every position verified) and records per round and draft position every
feature of :data:`dspark.confidence.FEATURES` (the head's logit and functions of softmax(Ũ_j)).
It then fits, per position, on the *fit* prompts and scores on the *eval* prompts:

* ``head-max-prob``: the linear stack of the head and the max-prob proxy, STS + bias on top;
* ``stacked``: the logistic regression on ``--features`` (linear, and with their squares — the
  shipped form, calibrated as fitted), :func:`dspark.confidence.fit_stacked`.

    python scripts/confidence_features.py --drafter dspark-5l-xl --split parity \\
        --fit-prompts RUNS/data12/calibration_prompts.jsonl --fit-per-domain 230 --out RUNS/conf-stacked

``--split parity`` fits and scores on the two halves of --fit-prompts by prompt hash, as
`dspark calibrate` splits them, and also reports the swapped direction (fit on the other half).
Rounds are cached in OUT (re-running resumes). OUT/confidence_features.{json,md} hold the figures,
OUT/confidence.json the stacked model with squares fitted on the fit rounds: copied into a
checkpoint folder, the engine uses it by default, with no calibrator on top.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


class _Recorder:
    """A confidence model that passes the head's logits through and records every feature of each
    block, keyed by the round's head-logit row (the engine stores exactly that row per round)."""

    name = "recorder"
    calibrated = False

    def __init__(self, names: list[str]) -> None:
        self.names, self.rows = names, {}

    def confidence_logits(self, block):
        from dspark.confidence import confidence_features

        z = block.confidence_logits.float()  # [R, γ]
        feats = confidence_features(block, self.names)  # [R, γ, F]
        for i in range(z.shape[0]):
            self.rows[tuple(z[i].tolist())] = feats[i]
        return z


def record(out: Path, name: str, prompts, target, drafter, names: list[str], args) -> dict:
    """Rounds and features [N, γ, F] of one prompt set, cached in OUT/NAME-features.pt."""
    from dspark.evaluation.rounds import collect_rounds
    from dspark.types import SamplingParams

    path = out / f"{name}-features.pt"
    if path.is_file():
        saved = torch.load(path)
        if saved["names"] == names:
            return saved
    rec = _Recorder(names)
    r = collect_rounds(target, drafter, prompts, SamplingParams.greedy(), max_new_tokens=args.max_new_tokens,
                       concurrency=args.concurrency, confidence_model=rec)
    X = torch.stack([rec.rows[tuple(row)] for row in r.confidence_logits.float().tolist()])  # [N, γ, F]
    saved = {"names": names, "features": X, "accepted": r.accepted, "verified": r.verified,
             "head": r.confidence_logits.float(), "domain": list(r.domain), "prompts": len(prompts)}
    torch.save(saved, path)
    return saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="dspark-5l-xl")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fit-prompts", required=True)
    ap.add_argument("--fit-per-domain", type=int, default=40)
    ap.add_argument("--eval-prompts", default="src/dspark/data/natural_eval.jsonl")
    ap.add_argument("--eval-per-domain", type=int, default=10)
    ap.add_argument("--features", default="head,max-prob,margin", help="the stacked model's features")
    ap.add_argument("--l2", type=float, default=1e-3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--bins", type=int, default=20)
    ap.add_argument("--split", choices=("sets", "parity"), default="sets",
                    help="sets: fit on --fit-prompts, score on --eval-prompts; parity: fit and score on the two "
                         "halves of --fit-prompts by prompt hash, as `dspark calibrate` splits them")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import dspark
    from dspark.calibration import load_calibrator
    from dspark.checkpoints import resolve_checkpoint
    from dspark.confidence import FEATURES, StackedConfidence, fit_head_max_prob, fit_stacked
    from dspark.confidence_report import confidence_report
    from dspark.evaluation.drafter_specs import load_drafter_spec
    from dspark.evaluation.inputs import calibration_split, eval_prompts
    from dspark.targets import load_target

    chosen = args.features.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(args.target, getattr(torch, args.dtype))
    _, drafter, _ = load_drafter_spec(args.drafter, target)
    own = getattr(drafter, "confidence_model", None)  # a folder's stacked confidence.json, scored as shipped
    own = own if isinstance(own, StackedConfidence) else None
    cal_path = resolve_checkpoint(args.drafter) / "calibration.json"  # the head's calibration
    head_cal = load_calibrator(cal_path) if cal_path.is_file() else None
    if args.split == "parity":  # dspark calibrate's own split
        fit_p, test_p = calibration_split(eval_prompts(args.fit_prompts, args.fit_per_domain))
    else:
        fit_p, test_p = eval_prompts(args.fit_prompts, args.fit_per_domain), eval_prompts(args.eval_prompts, args.eval_per_domain)
    if {p.key for p in fit_p} & {p.key for p in test_p}:
        sys.exit("the fit and eval prompt sets share prompts")
    names = sorted(FEATURES)
    data = {s: record(out, s, ps, target, drafter, names, args) for s, ps in (("fit", fit_p), ("eval", test_p))}
    cols = [names.index(f) for f in chosen]

    def models(fit: dict) -> dict:
        X = fit["features"]
        hmp = fit_head_max_prob(X[..., names.index("head")], X[..., names.index("max-prob")], fit["accepted"], fit["verified"])
        z = hmp.stack(X[..., names.index("head")], X[..., names.index("max-prob")])
        return {"hmp": hmp, "hmp_cal": dspark.get_calibrator("sts-bias").fit(z, fit["accepted"], fit["verified"]),
                "linear": fit_stacked(X[..., cols], fit["accepted"], fit["verified"], features=chosen, squares=False, l2=args.l2),
                "squares": fit_stacked(X[..., cols], fit["accepted"], fit["verified"], features=chosen, l2=args.l2)}

    def rows(m: dict, ev: dict) -> dict:
        X = ev["features"]
        hmp = m["hmp"].stack(X[..., names.index("head")], X[..., names.index("max-prob")])
        return {
            "confidence head (raw)": torch.sigmoid(ev["head"]),
            "confidence head (shipped calibration)": head_cal.calibrate(ev["head"]).float() if head_cal else None,
            "max-prob (raw)": torch.sigmoid(X[..., names.index("max-prob")]),
            "head-max-prob + STS + bias": m["hmp_cal"].calibrate(hmp).float(),
            f"stacked {'+'.join(chosen)} (linear)": torch.sigmoid(m["linear"].apply(X[..., cols])),
            f"stacked {'+'.join(chosen)} with squares (shipped form)": torch.sigmoid(m["squares"].apply(X[..., cols])),
            f"the drafter's own {own.name} confidence.json (as shipped)":
                torch.sigmoid(own.apply(X[..., [names.index(f) for f in own.features]])) if own is not None else None,
        }

    fitted = models(data["fit"])
    runs = {"fit → eval": (fitted, data["eval"])}  # run → (models, the rounds they are scored on)
    if args.split == "parity":  # the other direction: fitted on the eval half, scored on the fit half
        runs["eval → fit (swapped)"] = (models(data["eval"]), data["fit"])
    report = {run: {name: confidence_report(c, ev["accepted"], ev["verified"], args.bins).to_dict()
                    for name, c in rows(m, ev).items() if c is not None} for run, (m, ev) in runs.items()}
    shipped = fitted["squares"]
    held = report["fit → eval"][f"stacked {'+'.join(chosen)} with squares (shipped form)"]
    shipped.save(out / "confidence.json", drafter=args.drafter, fit_rounds=len(data["fit"]["accepted"]),
                 fit_prompts=args.fit_prompts, held_out={"rounds": len(data["eval"]["accepted"]),
                                                         "auroc": held["auroc"], "ece": held["ece"]})
    command = " ".join(["python", "scripts/confidence_features.py", *(argv if argv is not None else sys.argv[1:])])
    result = {"drafter": args.drafter, "features": chosen, "l2": args.l2,
              "rounds": {s: len(d["accepted"]) for s, d in data.items()},
              "prompts": {"fit": len(fit_p), "eval": len(test_p)}, "report": report, "command": command}
    (out / "confidence_features.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Confidence features of {args.drafter}", "",
          f"Rounds: fit {result['rounds']['fit']} ({len(fit_p)} prompts), eval {result['rounds']['eval']} "
          f"({len(test_p)} prompts). Survival AUROC and ECE ({args.bins} bins) per position.", ""]
    for run, rep in report.items():
        md += [f"## {run}", "", "| confidence | AUROC per position | ECE per position |", "|---|---|---|"]
        md += [f"| {name} | " + " ".join(f"{a:.3f}" for a in r["auroc"]) + " | "
               + " ".join(f"{100 * e:.1f} %" for e in r["ece"]) + " |" for name, r in rep.items()]
        md.append("")
    md += [f"Command: `{command}`", ""]
    (out / "confidence_features.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
