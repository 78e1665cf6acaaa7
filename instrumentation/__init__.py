"""Instrumentation: the protocol's messages, a bounded recorder, the WebSocket publisher, traces.

Everything here speaks PROTOCOL.md messages (plain dicts) and imports neither torch nor the
engine's model code, so a dashboard or notebook can reuse it. Import the submodules directly.
"""

PROTOCOL_VERSION = 1
# v1.1: `seq`, `hello.seq`, `hello.engine.instance`, abort acknowledged; v1.2: logprobs on
# `token` and `first_token`, the figures of an `aborted` request, prefill/decode/inference times
PROTOCOL_MINOR = 2
