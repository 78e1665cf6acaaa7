#!/usr/bin/env bash
# The chunked-prefill trade-off sweep on one GPU (issue 15, must-show 3, H200 part), unattended:
# Qwen3-0.6B's shape with random bf16 weights (assets/qwen3-0.6b, no download), the Azure
# conversation trace (assets/azure, no network needed) replayed from row 1000 with its own
# prompt and output lengths (clamped to the model's max_seq_len), its clock rescaled to RATE
# requests/s for DURATION s, both policies at four budgets.
#
#   bash scripts/sweep_gpu.sh [OUT]            # OUT defaults to sweep-gpu
#   RATE=6 DURATION=40 bash scripts/sweep_gpu.sh sweep-gpu
#
# Writes OUT/<policy>-<budget>.jsonl, OUT/summary.csv and OUT/tradeoff.html. The PNG needs a
# browser: back on a machine with chromium, `python -m instrumentation.sweep OUT` rewrites the
# summary and the figure, PNG included, from the traces alone.
set -euo pipefail
OUT=${1:-sweep-gpu}
PYTHON=${PYTHON:-python3}
RATE=${RATE:-4}            # at budget 32 a 1,000-token prompt needs ~32 steps: ~4/s nearly fills it
DURATION=${DURATION:-30}   # seconds of arrivals: ~120 requests a run, ~8 runs in < 10 minutes
exec "$PYTHON" -m engine.bench --workload sweep --device cuda \
  --model assets/qwen3-0.6b --load-format dummy --max-running-req 128 \
  --budgets 32,128,512,2048 --policies prefill_first,mixed --out "$OUT" \
  --trace-file assets/azure/AzureLLMInferenceTrace_conv.csv --trace-start 1000 \
  --rate "$RATE" --duration "$DURATION" --no-png
