"""Watch a real SGLang or vLLM server: adapters from their per-step output to the protocol.

`python -m instrumentation.watch SOURCE ...` reads one engine's own per-step output (SGLang's
scheduler log lines, vLLM's iteration log lines, forward-pass metrics or KV-cache events over
ZMQ) and serves it as stepscope protocol messages, so the dashboard can watch the engine a team
actually runs. These sources carry counts, not request ids: every step says which source it came
from and carries aggregates only (docs/watch.md lists the fields). Torch-free, like the rest of
`instrumentation`; pyzmq and msgpack (the `watch` extra) are imported only by the ZMQ sources.
"""
