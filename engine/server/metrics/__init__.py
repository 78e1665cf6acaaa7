"""`GET /metrics`: the engine's Prometheus metrics, folded from the same messages the WebSocket
clients see (prometheus.py), and vLLM's names and bucket boundaries under --metrics-compat vllm
(vllm.py)."""
