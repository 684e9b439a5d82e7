#!/usr/bin/env bash
# Evaluate the 1-layer SmolLM2 drafters trained by scripts/train_smollm2.sh, file them under data/smollm2-135m/retired/, and write
# docs/reports/2026-12-04-trained-drafters.md (docs/reports/2026-12-04-trained-drafters.md quotes these commands).
#   RUNS=runs bash scripts/eval_smollm2.sh
set -euo pipefail
[ -x .venv/bin/dspark ] && export PATH="$PWD/.venv/bin:$PATH"  # `make setup` installs dspark there
RUNS=${RUNS:-runs}
NAMES="dspark-gated dspark-vanilla dspark-rnn dflash eagle3 dspark-gated-long"
SHIP=src/dspark/checkpoints/smollm2-135m
RETIRED=data/smollm2-135m/retired  # none of these 1-layer drafters is packaged any more (issue 43)

# 1. file under retired/ (all of them now: the shipped dflash and eagle3 are train_paper_config.sh's
#    dflash-5l and eagle3-1l, so these 1-layer ones are dflash-legacy and eagle3-fused-legacy there):
#    weights, config, calibration and the training record of every finished run
where() { case $1 in dflash) echo "$RETIRED/dflash-legacy" ;; eagle3) echo "$RETIRED/eagle3-fused-legacy" ;;
                     *) echo "$RETIRED/$1" ;; esac; }
for name in $NAMES; do
  ck="$RUNS/$name/checkpoint"
  [ -f "$ck/calibration.json" ] || dspark calibrate --drafter "$ck" --prompts "$RUNS/data/eval_prompts.jsonl" --quiet
  dest=$(where "$name")
  mkdir -p "$dest"
  cp "$ck"/{config.json,model.safetensors,calibration.json,calibration_report.md} "$dest/"
  cp "$RUNS/$name/train.json" "$dest/"
done
cp "$RUNS/data/eval_prompts.jsonl" "$SHIP/"

# 2. the paper's metrics on the held-out prompts, greedy and T = 1 (resumable: finished runs are kept)
args=()
for name in $NAMES; do args+=(--drafter "$name=$(where "$name")"); done
dspark eval "${args[@]}" --drafter ngram --temperature 0 1 --per-domain 12 --max-new-tokens 96 \
  --out "$RUNS/eval" --quiet

# 3. the README main job, then the results page
dspark demo --drafter "$RETIRED/dspark-gated-long" --out out/demo
python scripts/results_smollm2.py --runs "$RUNS" --eval "$RUNS/eval" --demo out/demo
