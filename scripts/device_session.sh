#!/usr/bin/env bash
# One lent-GPU call for this round's device figures, unattended: the GPU tests, the page's
# autostart on CUDA (issue 11), the serving benchmark (issue 14) and the budget sweep (issue 15).
#
#   bash scripts/device_session.sh OUT SECTION...     SECTION: gpu_tests autostart serving sweep
#
# Carried (they are not on the machine, which has no internet): .whl (FlashInfer, websockets,
# the HTTP API, guidellm: `scripts/bench_serving.py --download-wheels .whl` and GPU.md's list),
# .whl-app (streamlit and plotly with what the image lacks, for the page under AppTest) and
# .dev/ss (a tokenizer-only copy of the bundled SmolLM2, which the dummy-weight configs borrow).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1; shift
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl $(ls .whl-app/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
export CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")") STEPSCOPE_CACHE=/tmp/ss
mkdir -p /tmp/ss && cp -r .dev/ss/. /tmp/ss/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
status=0
for section in "$@"; do
  echo "=== $section $(date +%T)"
  case $section in
    gpu_tests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu.py \
                 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" ;;
    autostart) timeout 300 python3 scripts/autostart_check.py --out "$OUT" \
                 --model assets/qwen3-0.6b --engine-args "--load-format dummy --http-port none" \
                 2>&1 | grep -v -e WARNING -e ScriptRunContext | tee "$OUT/autostart.log" ;;
    serving) OUT=$OUT REQUESTS=${REQUESTS:-400} RATE=${RATE:-32} \
               timeout 420 bash scripts/bench_serving_h200.sh 2>&1 | tail -60 ;;
    sweep) RATE=${SWEEP_RATE:-4} DURATION=${SWEEP_DURATION:-30} \
             timeout 540 bash scripts/sweep_gpu.sh "$OUT/sweep-gpu" 2>&1 | tail -30 ;;
    *) echo "unknown section $section"; status=2 ;;
  esac
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
echo "=== done $(date +%T)"
exit $status
