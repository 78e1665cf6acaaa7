#!/usr/bin/env bash
# The GPU work of one device call of the decode-kernel round (issue 17), unattended.
#
#   bash scripts/gpu_round.sh OUT kernels    # call 1: GPU tests, GEMV tuning, kernel tables
#                                            #   before/after, bench, Hugging Face static cache
#   bash scripts/gpu_round.sh OUT smollm2    # call 2, right after: the real SmolLM2 weights
#                                            #   (since 2026-12-02 without the gap section)
#   bash scripts/gpu_round.sh OUT tune       # call 3: tune the skinny matmuls (gemv_tuned.json),
#                                            #   then the GPU tests with that table in place
#   bash scripts/gpu_round.sh OUT final      # call 4, with that table committed: kernel tables
#                                            #   before/after, bench, Hugging Face static cache
# The second round (2026-12-02: the one-launch decode attention, the norms folded into the GEMVs,
# programmatic dependent launch):
#   bash scripts/gpu_round.sh OUT decode     # call Q: decode attention alone, kernels, bench
#   bash scripts/gpu_round.sh OUT measure    # call R (carries the GGUF's first half): tune the
#                                            #   decode attention per graph size (the table
#                                            #   waits in /tmp/persist), kernel tables
#                                            #   before/after, bench, Hugging Face static cache
#   bash scripts/gpu_round.sh OUT verify     # call S, right after (the second half): the GPU
#                                            #   tests with that table, the real SmolLM2's greedy
#                                            #   tokens and logits against Hugging Face (ran past
#                                            #   600 s: the next round splits it in two)
#   bash scripts/gpu_round.sh OUT tests      # the GPU tests alone (carry the GGUF's first half)
#   bash scripts/gpu_round.sh OUT smollm2    # right after (the second half): SmolLM2's logits
#                                            #   and greedy tokens against Hugging Face
#   bash scripts/gpu_round.sh OUT stash      # only keep the GGUF's first half for the next call
#   bash scripts/gpu_round.sh OUT greedy     # right after (the second half): SmolLM2's greedy
#                                            #   tokens against Hugging Face only
#
# Carried (the machine has no internet): .whl (FlashInfer 0.5.3, apache-tvm-ffi, gguf),
# .dev/ss.tgz (a tokenizer-only copy of the converted SmolLM2, which the dummy-weight configs
# borrow) and one half of the bundled GGUF per call (.dev/gguf.partaa, then .dev/gguf.partab:
# the 98 MB file is over one call's carry). The first half waits in /tmp/persist for the second
# call, which must find the machine still warm.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1
CALL=$2
mkdir -p "$OUT" /tmp/ss /tmp/persist
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
export CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")") STEPSCOPE_CACHE=/tmp/ss
[ -d /tmp/ss/SmolLM2-135M-Instruct ] || tar -xzf .dev/ss.tgz -C /tmp/ss
for part in .dev/gguf.part*; do [ -f "$part" ] && cp "$part" /tmp/persist/; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case $CALL in
  kernels)
    python3 -m scripts.gpu_check --out "$OUT" --deadline-s 555 --bench-quick \
      --sections warmup,bandwidth,pytest,gemv,kernels,bench,hf_static --hf-static-batches 1,64 \
      --pytest-files tests/gpu/test_gpu.py,tests/engine/test_fused_kernels.py 2>&1 | tee "$OUT/log.txt"
    ;;
  smollm2)
    if [ -f /tmp/persist/gguf.partaa ] && [ -f /tmp/persist/gguf.partab ]; then
      cat /tmp/persist/gguf.partaa /tmp/persist/gguf.partab > /tmp/smollm2.gguf
      export SMOLLM2_GGUF=/tmp/smollm2.gguf
      sha256sum /tmp/smollm2.gguf | cut -c1-16
    else
      echo "the first half of the GGUF is not here (a fresh machine): random weights only"
    fi
    python3 -m scripts.gpu_check --out "$OUT" --deadline-s 555 --bench-quick \
      --sections warmup,smollm2 2>&1 | tee "$OUT/log.txt"
    ;;
  stash) ls -la /tmp/persist ;;
  greedy)
    cat /tmp/persist/gguf.partaa /tmp/persist/gguf.partab > /tmp/smollm2.gguf || exit 3
    export SMOLLM2_GGUF=/tmp/smollm2.gguf
    python3 -m scripts.gpu_check --out "$OUT" --deadline-s 560 --smollm2-greedy-only \
      --sections warmup,smollm2 2>&1 | tee "$OUT/log.txt"
    ;;
  tests)
    PYTEST_ADDOPTS="-n 6" python3 -m scripts.gpu_check --out "$OUT" --deadline-s 560 \
      --sections warmup,pytest --pytest-files tests/gpu/test_gpu.py,tests/engine/test_fused_kernels.py \
      2>&1 | tee "$OUT/log.txt"
    ;;
  tune)
    python3 -m scripts.gpu_check --out "$OUT" --deadline-s 300 \
      --sections warmup,bandwidth,gemv 2>&1 | tee "$OUT/log.txt"
    cp "$OUT/gemv_tuned.json" engine/kernels/gemv_tuned.json  # what the tests' engines load
    PYTEST_ADDOPTS="-n 6" python3 -m scripts.gpu_check --out "$OUT/tests" --deadline-s 300 \
      --sections pytest --pytest-files tests/gpu/test_gpu.py,tests/engine/test_fused_kernels.py \
      2>&1 | tail -40
    ;;
  final)
    timeout 120 python3 -m pytest -q -x -n 0 -p no:cacheprovider tests/gpu/test_gpu.py \
      -k skinny 2>&1 | grep -v Warning | tail -30 > "$OUT/skinny_test.txt"
    python3 -m scripts.gpu_check --out "$OUT" --deadline-s 540 --bench-quick \
      --sections warmup,bandwidth,kernels,bench,hf_static --hf-static-batches 1,64 \
      2>&1 | tee "$OUT/log.txt"
    ;;
  decode)
    python3 -m scripts.gpu_check --out "$OUT" --deadline-s 520 --bench-quick \
      --sections warmup,bandwidth,decode,kernels,bench 2>&1 | tee "$OUT/log.txt"
    ;;
  measure)
    python3 -m scripts.gpu_check --out "$OUT" --deadline-s 560 --bench-quick \
      --sections warmup,bandwidth,decode,kernels,bench,hf_static --hf-static-batches 1,64 \
      2>&1 | tee "$OUT/log.txt"
    cp "$OUT/decode_tuned.json" /tmp/persist/
    ;;
  verify)
    if [ -f /tmp/persist/decode_tuned.json ]; then
      cp /tmp/persist/decode_tuned.json engine/kernels/decode_tuned.json
    else
      echo "no tuned decode table from the last call (a fresh machine): the default rule"
    fi
    if [ -f /tmp/persist/gguf.partaa ] && [ -f /tmp/persist/gguf.partab ]; then
      cat /tmp/persist/gguf.partaa /tmp/persist/gguf.partab > /tmp/smollm2.gguf
      export SMOLLM2_GGUF=/tmp/smollm2.gguf
    fi
    PYTEST_ADDOPTS="-n 6" python3 -m scripts.gpu_check --out "$OUT" --deadline-s 560 \
      --bench-quick --sections warmup,pytest,smollm2 \
      --pytest-files tests/gpu/test_gpu.py,tests/engine/test_fused_kernels.py 2>&1 | tee "$OUT/log.txt"
    ;;
  *) echo "unknown call $CALL" >&2; exit 2 ;;
esac
