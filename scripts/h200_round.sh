#!/usr/bin/env bash
# One device call for this round's serving measurements on the H200, unattended:
#   1. admission: `reserve` against `optimistic` on long, variable outputs (issue 25), which
#      also JIT-compiles FlashInfer once for what follows;
#   2. the gateway's routing policies over 4 replicas sharing the GPU (issue 28).
#
#   bash scripts/h200_round.sh OUT            (carry .whl and .whl-fleet)
#
# Carried (the machine has no internet): .whl (FlashInfer 0.5.3, apache-tvm-ffi) and .whl-fleet
# (websockets, starlette, uvicorn, fastapi, pydantic, orjson, setproctitle, sglang-router 0.3.2;
# qwen3/: the Qwen3-0.6B config with SmolLM2's tokenizer beside it, for random weights).
# DEVICE=cpu MODEL=DIR runs the same steps on a CPU, small, to check the script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-.whl-fleet/qwen3}
if [ "$DEVICE" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl-fleet/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  export MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")")
  PY=python3
  LOAD="--load-format dummy"
  SCALE=${SCALE:-1}
else
  PY=${PY:-.venv/bin/python}
  LOAD=""
  SCALE=${SCALE:-0}
fi
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
echo "== admission ($(date +%T))"
if [ -f scripts/bench_admission.py ] && [ -z "${SKIP_ADMISSION:-}" ]; then
  if [ "$SCALE" = 1 ]; then ADM="--requests 128 --max-output 512 --num-pages 1200 --max-running-req 128 --budget 2048"; else ADM="--requests 16 --max-output 48"; fi
  timeout 150 $PY scripts/bench_admission.py --device "$DEVICE" --model "$MODEL" $LOAD $ADM \
    2>&1 | tee "$OUT/admission.txt" | tail -30
fi
echo "== fleet ($(date +%T))"
if [ "$SCALE" = 1 ]; then
  FLEET="--replicas 4 --requests 128 --inflight 32 --system-words 1200 --max-tokens 64"
  ENGINE="--num-pages 6000 --max-running-req 64 --no-cuda-graph"
else
  FLEET="--replicas 2 --requests 12 --inflight 4 --system-words 40 --max-tokens 8"
  ENGINE="--threads 1"
fi
timeout 210 $PY scripts/bench_fleet.py $FLEET --out "$OUT/fleet.json" -- \
  --model "$MODEL" --device "$DEVICE" $LOAD $ENGINE 2>"$OUT/fleet.err" | tee "$OUT/fleet.txt"
tail -c 3000 "$OUT/fleet.err"
echo "== done ($(date +%T))"
