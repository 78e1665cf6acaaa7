#!/usr/bin/env bash
# Issue 27, Must show 1, on a lent H200 in one device call: the HTTP path at engine speed with
# the API server in its own process (Qwen3-0.6B's shape, random bf16 weights, policy mixed,
# budget 8192, 512-token prompts, 256 output tokens).
#
#   1. FlashInfer's JIT build (a short LLM.generate compiles every kernel once);
#   2. bench_http.py: engine alone against HTTP at 1, 16, 64 and 256 streams, with the step time
#      and ITL p50 / p99; the HTTP half also through the baseline tree's server when carried;
#   3. bench_server.py overhead: the decode step through the server with 1 WebSocket client,
#      then 8 and /metrics each second, against LLM alone in the same process;
#   4. bench_sampler.py: the decode step greedy and sampled (this tree and the baseline's);
#   5. guidellm at 32 requests/s (bench_serving.py, policy mixed), its step time in its table.
#
# Here, once (needs internet): the wheels, the model stub (config + SmolLM2's tokenizer files)
# and the baseline tree (engine/ and instrumentation/ of BASE, default main) into .whl/:
#     bash scripts/gpu_issue27.sh --prepare [BASE]
# On the device (carry .whl):
#     OUT=$OUT bash scripts/gpu_issue27.sh
# A dry run on CPU (no wheels installed, tiny sizes):
#     DEVICE=cpu MODEL=tiny PROMPT=16 OUTPUT=8 STREAMS=1,4 RUNNING=4 SKIP_INSTALL=1 \
#       STEPS="http overhead" bash scripts/gpu_issue27.sh
# HTTP_ARGS: more bench_http.py flags, e.g. "--streams-per-client 16" or
#   "--server-args=--max-waiting=64" (a variant of the server measured in the same call).
# Writes $OUT/issue27.log; about 7 minutes on a fresh machine.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  set -e
  base=${2:-main}
  py=${PYTHON:-.venv/bin/python}
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  mkdir -p .whl
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl flashinfer-python==0.5.3 \
    apache-tvm-ffi==0.1.15.post2 websockets==17.4 pyzmq==27.3.0 orjson==3.13.0
  "$py" scripts/bench_serving.py --download-wheels .whl  # guidellm and the HTTP stack
  tok=$("$py" -c "from engine.models.loader import resolve; print(resolve('smollm2').path)")
  mkdir -p .whl/qwen3
  cp assets/qwen3-0.6b/config.json "$tok"/tokenizer.json "$tok"/tokenizer_config.json .whl/qwen3/
  [ -f "$tok/chat_template.jinja" ] && cp "$tok/chat_template.jinja" .whl/qwen3/
  rm -rf .whl/base && mkdir -p .whl/base
  git archive "$base" engine instrumentation | tar -x -C .whl/base
  du -sh .whl
  exit 0
fi

OUT=${OUT:-out}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-.whl/qwen3}
PROMPT=${PROMPT:-512}
OUTPUT=${OUTPUT:-256}
STREAMS=${STREAMS:-1,16,64,256}
RUNNING=${RUNNING:-64}
STEPS=${STEPS:-jit sampler http overhead guidellm}
mkdir -p "$OUT"
LOG="$OUT/issue27.log"
exec > >(tee -a "$LOG") 2>&1

if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
command -v nvcc >/dev/null && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(which nvcc)")")}
export STEPSCOPE_CACHE=${STEPSCOPE_CACHE:-/tmp/ss}
PY=${PY:-python3}
LOAD=(--load-format dummy)
[ "$MODEL" = tiny ] && LOAD=()
BASE=()
[ -d .whl/base/engine ] && BASE=(--baseline-root .whl/base)
has() { [[ " $STEPS " == *" $1 "* ]]; }
section() { echo; echo "=== $1 ($(date +%T))"; }

section "environment"
$PY -c "import torch, zmq, orjson, websockets, starlette, uvicorn, pydantic; print('torch',
torch.__version__, 'cuda', torch.cuda.is_available(), 'zmq', zmq.__version__)" || exit 1
nproc

if has jit && [ "$DEVICE" = cuda ]; then
  section "FlashInfer JIT warm-up"
  timeout 240 $PY - "$MODEL" <<'EOF'
import sys, time
from engine import LLM, SamplingParams
t = time.perf_counter()
llm = LLM(sys.argv[1], load_format="dummy", device="cuda", policy="mixed",
          max_extend_tokens=8192, max_running_req=8, max_seq_len=1024, progress=False)
prompts = [[100 + (7 * i + j) % 40000 for j in range(512)] for i in range(4)]
llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
print(f"warm in {time.perf_counter() - t:.0f} s")
EOF
fi

if has http; then
  section "bench_http: engine alone against HTTP"
  timeout 300 $PY scripts/bench_http.py --model "$MODEL" "${LOAD[@]}" --device "$DEVICE" \
    --policy mixed --budget 8192 --prompt-len "$PROMPT" --output-len "$OUTPUT" \
    --streams "$STREAMS" "${BASE[@]}" ${HTTP_ARGS:-}
fi

if has sampler; then
  section "bench_sampler: greedy against temperature sampling, this tree and the baseline"
  for root in . ${BASE[1]:-}; do
    timeout 150 $PY scripts/bench_sampler.py --model "$MODEL" "${LOAD[@]}" --device "$DEVICE" \
      --streams "$RUNNING" --prompt-len "$PROMPT" --output-len 128 --root "$root"
  done
fi

if has overhead; then
  for clients in "1" "8 --metrics-every 1"; do
    section "bench_server overhead, clients $clients"
    # shellcheck disable=SC2086
    timeout 150 $PY scripts/bench_server.py overhead --model "$MODEL" "${LOAD[@]}" \
      --device "$DEVICE" --policy mixed --budget 8192 --max-running "$RUNNING" \
      --lengths "${PROMPT}x$RUNNING" --max-tokens "$OUTPUT" --clients $clients
  done
fi

if has guidellm; then
  section "guidellm at 32 requests/s"
  timeout 300 $PY scripts/bench_serving.py --model "$MODEL" "${LOAD[@]}" --device "$DEVICE" \
    --policy mixed --requests 400 --rate 32 --prompt-tokens 512 --output-tokens 128 \
    --max-running-req 64 --max-extend-tokens 2048 --server-arg=--max-seq-len \
    --server-arg=2048 --wheels .whl --out "$OUT/serving-h200-mixed"
fi
section "done"
