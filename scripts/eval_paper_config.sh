#!/usr/bin/env bash
# Issue 12: evaluate the drafters scripts/train_paper_config.sh trained (whichever have finished) on
# the shipped natural-prompt eval set and on the templated one, then write the paper's findings.
#   RUNS=runs bash scripts/eval_paper_config.sh
# Greedy, gamma = 7, every valid draft position verified; bf16 target. Resumable: `dspark eval`
# keeps finished (drafter, temperature) runs under OUT/rounds/.
set -euo pipefail
[ -x .venv/bin/dspark ] && export PATH="$PWD/.venv/bin:$PATH"
RUNS=${RUNS:-runs}
PER_DOMAIN=${PER_DOMAIN:-10}
args=()
for name in dspark-5l dflash-5l eagle3-1l dspark-2l dspark-5l-long dspark-5l-xl; do
  [ -f "$RUNS/$name/checkpoint/config.json" ] && args+=(--drafter "$name=$RUNS/$name/checkpoint")
done
[ ${#args[@]} -gt 0 ] || { echo "no finished drafter under $RUNS (run scripts/train_paper_config.sh)" >&2; exit 1; }
common=(--drafter dspark-vanilla-ref=data/smollm2-135m/retired/dspark-vanilla-ref --temperature 0 --per-domain "$PER_DOMAIN" --dtype bfloat16 --quiet)
dspark eval "${args[@]}" "${common[@]}" --prompts src/dspark/data/natural_eval.jsonl --out "$RUNS/eval12-natural"
dspark eval "${args[@]}" "${common[@]}" --out "$RUNS/eval12-templated"
python scripts/paper_findings.py --eval "$RUNS/eval12-natural" --dspark dspark-5l --dflash dflash-5l \
  --eagle3 eagle3-1l --dspark-small dspark-2l --runs "$RUNS" --markdown docs/reports/2026-12-02-paper-findings.md \
  --draft-times docs/reports/figures/draft_time_by_layers_bf16.json
