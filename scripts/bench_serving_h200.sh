#!/usr/bin/env bash
# The serving benchmark on a lent H200, unattended, in one device call: guidellm against
# `python -m engine.server` with the Qwen3-0.6B shape (random weights), both policies.
#
# Here, once (needs internet), add guidellm's wheels and the HTTP API's to the engine's .whl/:
#     .venv/bin/python scripts/bench_serving.py --download-wheels .whl
# On the device (carry .whl and the SmolLM2 tokenizer stub under $STEPSCOPE_CACHE, as for
# scripts/gpu_check/):
#     OUT=$OUT bash scripts/bench_serving_h200.sh
# Writes $OUT/serving-h200-<policy>/{table.md,guidellm.json,trace.jsonl,server.log} and prints
# the tables. About 4 minutes: FlashInfer's JIT build on a fresh machine, then two short runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
REQUESTS=${REQUESTS:-400}
RATE=${RATE:-32}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(which nvcc)")")}
export STEPSCOPE_CACHE=${STEPSCOPE_CACHE:-/tmp/ss}
python3 -c "import guidellm, starlette, uvicorn, prometheus_client; print('imports ok')"
for policy in prefill_first mixed; do
  python3 scripts/bench_serving.py --model assets/qwen3-0.6b --load-format dummy --device cuda \
    --policy "$policy" --requests "$REQUESTS" --rate "$RATE" --prompt-tokens 512 \
    --output-tokens 128 --max-running-req 64 --max-extend-tokens 2048 \
    --server-arg=--max-seq-len --server-arg=2048 --wheels .whl \
    --out "$OUT/serving-h200-$policy"
done
