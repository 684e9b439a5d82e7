"""Which raw confidence ranks a drafter's rounds best: its confidence head, the max-prob proxy, or both?

Issue 12 asks for AUROC ≥ 0.8 at every position; dspark-5l-xl's confidence head gives 0.74 / 0.75 /
0.78 at positions 1–3, and no calibration of one logit changes its ranking. This script decodes the
same prompts twice (every position verified, greedy, so the rounds are identical) with the
``draft-head`` and the ``max-prob`` confidence models, fits per position a logistic regression of
the conditional acceptance on both logits on the *fit* prompts (``dspark.confidence.fit_head_max_prob``), and reports survival AUROC and ECE
(20 bins) of each on the *eval* prompts (disjoint: calibration prompts vs the shipped natural eval set).

    python scripts/confidence_features.py --drafter dspark-5l-xl \
        --fit-prompts /work/runs/data12/calibration_prompts.jsonl --fit-per-domain 40 \
        --eval-prompts src/dspark/data/natural_eval.jsonl --eval-per-domain 10 --out /work/runs/conf-features

Rounds are cached in OUT (re-running resumes); OUT/confidence_features.{json,md} hold the figures,
OUT/confidence.json the fitted weights (``dspark.get_confidence_model("head-max-prob", path=...)``) and
OUT/calibration.json STS + bias fitted on the stacked logits: copied together into a checkpoint
folder, the engine uses both by default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

MODELS = ("draft-head", "max-prob")


def rounds_for(out: Path, name: str, prompts, target, drafter, model: str, args):
    from dspark.evaluation import Rounds, collect_rounds, save_json
    from dspark.types import SamplingParams

    path = out / f"{name}-{model}.json"
    if path.is_file():
        return Rounds.from_dict(json.loads(path.read_text()))
    r = collect_rounds(target, drafter, prompts, SamplingParams.greedy(), max_new_tokens=args.max_new_tokens,
                       concurrency=args.concurrency, confidence_model=model)
    save_json(r.to_dict(), path)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="dspark-5l-xl")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fit-prompts", required=True)
    ap.add_argument("--fit-per-domain", type=int, default=40)
    ap.add_argument("--eval-prompts", default="src/dspark/data/natural_eval.jsonl")
    ap.add_argument("--eval-per-domain", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--bins", type=int, default=20)
    ap.add_argument("--split", choices=("sets", "parity"), default="sets",
                    help="sets: fit on --fit-prompts, score on --eval-prompts; parity: fit and score on the two "
                         "halves of --fit-prompts by prompt hash, as `dspark calibrate` splits them")
    ap.add_argument("--head-rounds", help="a calibration_rounds.json from `dspark calibrate` (with --split parity "
                                          "and its prompts): its rounds stand for the draft-head decodes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from dspark.confidence import fit_head_max_prob
    from dspark.evaluation_runs import calibration_split, eval_prompts, load_drafter_spec
    from dspark.metrics import confidence_report
    from dspark.targets import load_target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(args.model, getattr(torch, args.dtype))
    _, drafter, calibrator = load_drafter_spec(args.drafter, target)
    if args.split == "parity":  # dspark calibrate's own split
        fit_p, test_p = calibration_split(eval_prompts(args.fit_prompts, args.fit_per_domain))
        sets = {"fit": fit_p, "eval": test_p}
    else:
        sets = {"fit": eval_prompts(args.fit_prompts, args.fit_per_domain),
                "eval": eval_prompts(args.eval_prompts, args.eval_per_domain)}
    fit_keys = {p.key for p in sets["fit"]}
    if fit_keys & {p.key for p in sets["eval"]}:
        sys.exit("the fit and eval prompt sets share prompts")
    saved = json.loads(Path(args.head_rounds).read_text()) if args.head_rounds else None
    r = {}
    for s, ps in sets.items():
        for m in MODELS:
            if m == "draft-head" and saved is not None:
                from dspark.evaluation import Rounds

                r[s, m] = Rounds.from_dict(saved["fit" if s == "fit" else "test"])
            else:
                r[s, m] = rounds_for(out, s, ps, target, drafter, m, args)
    for s in sets:  # greedy and every position verified: both decodes are the same rounds
        a, b = r[s, MODELS[0]], r[s, MODELS[1]]
        if not (torch.equal(a.accepted, b.accepted) and torch.equal(a.verified, b.verified) and a.prompt == b.prompt):
            sys.exit(f"{s}: the two decodes differ round by round; cannot pair their confidences")
    ev, fit = r["eval", "draft-head"], r["fit", "draft-head"]
    stack = fit_head_max_prob(fit.confidence_logits, r["fit", "max-prob"].confidence_logits, fit.accepted, fit.verified)

    def stacked(s: str) -> torch.Tensor:  # [N, γ] the model's own formula, on the recorded logits
        return stack.stack(r[s, "draft-head"].confidence_logits, r[s, "max-prob"].confidence_logits)

    comb = stacked("eval")
    import dspark

    sts_bias = dspark.get_calibrator("sts-bias").fit(stacked("fit"), fit.accepted, fit.verified)
    sts_bias.save(out / "calibration.json")  # fitted on the stacked logits: ships beside confidence.json
    weights = [list(w) for w in stack.weights]
    stack.save(out / "confidence.json", drafter=args.drafter, fit_rounds=len(fit.domain), fit_prompts=args.fit_prompts)
    rows = {
        "confidence head (raw)": torch.sigmoid(ev.confidence_logits.float()),
        "confidence head (shipped calibration)": calibrator.calibrate(ev.confidence_logits.float()).float()
        if calibrator is not None else None,
        "max-prob (raw)": torch.sigmoid(r["eval", "max-prob"].confidence_logits.float()),
        "head-max-prob (stacked, fitted on the fit rounds)": torch.sigmoid(comb),
        "head-max-prob + STS + bias (fitted on the fit rounds)": sts_bias.calibrate(comb).float(),
    }
    report = {name: confidence_report(c, ev.accepted, ev.verified, args.bins).to_dict()
              for name, c in rows.items() if c is not None}
    result = {"drafter": args.drafter, "fit_rounds": len(r["fit", "draft-head"].domain), "eval_rounds": len(ev.domain),
              "fit_prompts": len(sets["fit"]), "eval_prompts": len(sets["eval"]), "weights": weights,
              "report": report, "command": " ".join(["python", "scripts/confidence_features.py", *sys.argv[1:]])}
    (out / "confidence_features.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Confidence features of {args.drafter}", "",
          f"Fitted on {result['fit_rounds']} rounds ({result['fit_prompts']} prompts), scored on "
          f"{result['eval_rounds']} rounds ({result['eval_prompts']} prompts). Survival AUROC and ECE ({args.bins} bins) per position.", "",
          "| confidence | AUROC per position | ECE per position |", "|---|---|---|"]
    for name, rep in report.items():
        md.append(f"| {name} | " + " ".join(f"{a:.3f}" for a in rep["auroc"]) + " | "
                  + " ".join(f"{100 * e:.1f} %" for e in rep["ece"]) + " |")
    md += ["", "Weights per position [w_head, w_maxprob, bias]: "
           + "; ".join("[" + ", ".join(f"{v:+.2f}" for v in w) + "]" for w in weights), "",
           f"Command: `{result['command']}`", ""]
    (out / "confidence_features.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
