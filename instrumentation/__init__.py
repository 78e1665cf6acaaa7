"""Instrumentation: the protocol's messages, its one fold and metrics, the publisher, traces.

Everything here speaks docs/protocol.md messages (plain dicts) and imports neither torch nor the
engine's model code, so a dashboard or notebook can reuse it. Import the submodules directly.
"""

PROTOCOL_VERSION = 1
# v1.1: `seq`, `hello.seq`, `hello.engine.instance`, abort acknowledged;
# v1.2: `max_stall_seconds` is the protocol's stall everywhere, `max_itl_seconds` the longest gap;
# v1.3: admission modes and retraction (`retracted` events, `recompute` items, waiting reasons);
# v1.4: logprobs on `token` and `first_token`, the figures of an `aborted` request, and
# `prefill_time_seconds`, `decode_time_seconds`, `inference_time_seconds`;
# v1.5: `delay` on end events and ended request records (who delayed each request, and why)
PROTOCOL_MINOR = 5
