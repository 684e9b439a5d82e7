#!/usr/bin/env bash
# Retrain the 1-layer legacy-layout drafters of docs/reports/2026-12-04-trained-drafters.md (all kept in
# data/smollm2-135m/retired/: the DSpark ones, and dflash / eagle3 as dflash-legacy /
# eagle3-fused-legacy; the shipped dspark-5l-xl, dflash and eagle3 come from scripts/train_paper_config.sh).
# Same data, same batches, same number of optimizer steps for every drafter; each step is one
# global batch of SEQS sequences. Resumable: re-running skips finished runs and resumes
# interrupted ones from RUNS/<name>/state.pt.
#   RUNS=runs bash scripts/train_smollm2.sh          (ONLY="dflash eagle3" trains a subset, e.g. to
#                                                     run two queues side by side with OMP_NUM_THREADS=1)
set -euo pipefail
[ -x .venv/bin/dspark ] && export PATH="$PWD/.venv/bin:$PATH"  # `make setup` installs dspark there
RUNS=${RUNS:-runs}
DATA=${DATA:-$RUNS/data}
STEPS=${STEPS:-1500}
SEQS=${SEQS:-8}
COMMON=(--data "$DATA" --steps "$STEPS" --seqs-per-step "$SEQS" --anchors 32 --gamma 7 --num-layers 1
        --draft-vocab 4096 --lr 1e-3 --dtype "${DTYPE:-bfloat16}" --checkpoint-every 25 --save-dtype int8)

# 1. self-distillation data (the target writes the responses; held-out prompts split by hash)
[ -f "$DATA/train.jsonl" ] || dspark data --out "$DATA" --per-domain 600 --concurrency 48 --max-new-tokens 128

# 2. drafters (the first run also builds the teacher-feature cache in $DATA/features)
train() {
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  [ -f "$RUNS/$name/checkpoint/config.json" ] || dspark train --out "$RUNS/$name" "${COMMON[@]}" "$@"
}
train dspark-gated   --kind dspark --head gated-markov   --rank 128
train dspark-vanilla --kind dspark --head vanilla-markov --rank 128
train dspark-rnn     --kind dspark --head rnn            --rank 128
train dflash         --kind dflash
train eagle3         --kind eagle3

# 3. STS calibration: 40 held-out prompts per domain after the 12 that `dspark eval` uses, fitted on
#    half of them (by hash) and reported on the other half
for name in ${ONLY:-dspark-gated dspark-vanilla dspark-rnn dflash eagle3}; do
  [ -f "$RUNS/$name/checkpoint/calibration.json" ] || \
    dspark calibrate --drafter "$RUNS/$name/checkpoint" --prompts "$DATA/eval_prompts.jsonl" --quiet
done

# 4. the default drafter, reference layout (servable by vLLM after `dspark convert --to speculators`):
#    vanilla head, 2 Qwen3 draft layers, the full vocabulary, the full-vocabulary teacher (its own
#    feature cache, built in bf16), 8 anchors per sequence (the full-vocabulary step costs ~4x more)
if [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" dspark-vanilla-ref "* ]]; then
  [ -f "$RUNS/dspark-vanilla-ref/checkpoint/config.json" ] || \
    dspark train --out "$RUNS/dspark-vanilla-ref" --data "$DATA" --feature-cache "$DATA/features-full-bf16" \
      --teacher-dtype bfloat16 --kind dspark --head vanilla-markov --rank 128 --num-layers 2 --gamma 7 \
      --steps 3000 --seqs-per-step 8 --anchors 8 --lr 1e-3 --dtype "${DTYPE:-bfloat16}" --checkpoint-every 25 \
      --save-dtype int8
  [ -f "$RUNS/dspark-vanilla-ref/checkpoint/calibration.json" ] || \
    dspark calibrate --drafter "$RUNS/dspark-vanilla-ref/checkpoint" --prompts "$DATA/eval_prompts.jsonl" --quiet
fi

# 5. the previous main job's drafter (legacy layout): dspark-gated continued to 3× the steps (the cosine schedule re-spread
#    over 4500 steps from dspark-gated's step-1500 state); outside the equal-budget comparison
if [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" dspark-gated-long "* ]]; then
  if [ ! -f "$RUNS/dspark-gated-long/checkpoint/config.json" ]; then
    mkdir -p "$RUNS/dspark-gated-long"
    [ -f "$RUNS/dspark-gated-long/state.pt" ] || cp "$RUNS/dspark-gated/state.pt" "$RUNS/dspark-gated-long/"
    dspark train --out "$RUNS/dspark-gated-long" "${COMMON[@]/$STEPS/4500}" --kind dspark --head gated-markov --rank 128
  fi
  [ -f "$RUNS/dspark-gated-long/checkpoint/calibration.json" ] || \
    dspark calibrate --drafter "$RUNS/dspark-gated-long/checkpoint" --prompts "$DATA/eval_prompts.jsonl" --quiet
fi
