#!/usr/bin/env bash
# Issue 29's last device call, unattended: FlashInfer's JIT, the GPU tests (with the
# batch-invariant ones), then the after-figures: chunked = unchunked on 32 prompts, decode steps,
# the stall table.
#   bash scripts/gpu_issue29.sh OUT [PYTEST_TIMEOUT_S]
# Carried: .whl (flashinfer-python 0.5.3, apache-tvm-ffi 0.1.15.post2) one level up, and
# .dev/ss (a tokenizer-only copy of the bundled SmolLM2, which the dummy-weight configs borrow).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1
mkdir -p "$OUT" /tmp/ss
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site ../.whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
export CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")") STEPSCOPE_CACHE=/tmp/ss
cp -r .dev/ss/. /tmp/ss/
B=scripts/bench_prefill_gpu.py
echo "=== jit $(date +%T)"
python3 -c "import runpy; m = runpy.run_path('$B'); print('JIT s', m['jit_warmup']())" 2>&1 | tail -1
echo "=== pytest $(date +%T)"
timeout "${2:-150}" python3 -m pytest -q -n 12 -p no:cacheprovider tests/gpu/test_gpu.py \
  tests/engine/test_batch_invariant.py 2>&1 | grep -v -i warn | tail -40 | tee "$OUT/pytest.txt"
echo "=== bench $(date +%T)"
python3 $B --model assets/qwen3-0.6b --out "$OUT" --variants default \
  --sections chunked,stall,decode --deadline-s 70 2>&1 | grep -v -e USDT -e Warn -e _warn_once \
  | tee "$OUT/log.txt"
echo "=== done $(date +%T)"
