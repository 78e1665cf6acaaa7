"""`python -m instrumentation.watch SOURCE TARGET [options]`: watch a real SGLang or vLLM server.

    python -m instrumentation.watch sglang-log server.log --trace out.jsonl     # convert a log
    python -m instrumentation.watch sglang-log server.log --follow --port 8765  # watch it live
    python -m instrumentation.watch vllm-fpm tcp://127.0.0.1:20380 --port 8765
    python -m instrumentation.watch vllm-kv-events tcp://127.0.0.1:5557 --port 8765

Then `streamlit run app/main.py` and connect the page to the printed ws:// URL. docs/watch.md
describes every source, option and message field.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from instrumentation.watch.run import LOG_SOURCES, SOURCES, Watch, WatchConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m instrumentation.watch",
        description="Serve a real SGLang or vLLM server's per-step output as the stepscope protocol.",
    )
    p.add_argument("source", choices=SOURCES)
    p.add_argument("target", help="log file ('-' for stdin), or ZMQ endpoint (tcp://host:port)")
    p.add_argument("--follow", action="store_true", help="tail a growing log file")
    p.add_argument(
        "--pace", type=float, metavar="SPEED", help="replay a log at SPEED x its own timestamps"
    )
    p.add_argument("--port", type=int, help="serve the protocol on this port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--token", help="require this bearer token from clients")
    p.add_argument("--trace", help="write every message to this JSON-lines file")
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="also read vLLM KV events from here (or from a file made by --record-frames)",
    )
    p.add_argument(
        "--kv-replay",
        metavar="ENDPOINT",
        help="vLLM's KV-event replay socket (its replay_endpoint): missed batches are asked for",
    )
    p.add_argument(
        "--record-frames", metavar="FILE", help="keep the KV-event socket's raw messages in FILE"
    )
    p.add_argument(
        "--log-timezone",
        metavar="ZONE",
        help="the engine's time zone (e.g. UTC), to place KV events on its log's clock",
    )
    p.add_argument(
        "--zmq-bind", action="store_true", help="bind the ZMQ endpoint (engine connects)"
    )
    p.add_argument("--dp-rank", type=int, help="read only this data-parallel rank's steps")
    p.add_argument("--history", type=int, default=2000, help="steps kept for late clients")
    p.add_argument("--model", help="model name to show (else from the log, when it says)")
    p.add_argument("--openai-url", help="the engine's OpenAI endpoint, announced to the page")
    p.add_argument("--chunked-prefill-size", type=int, help="SGLang's chunk size, if not logged")
    p.add_argument("--decode-log-interval", type=int, help="SGLang's decode log interval (40)")
    p.add_argument("--max-total-tokens", type=int, help="SGLang's KV pool size in tokens")
    p.add_argument("--num-gpu-blocks", type=int, help="vLLM's KV pool size in blocks")
    return p


def config_from_args(args: argparse.Namespace) -> WatchConfig:
    engine = {k: v for k, v in (("model", args.model), ("openai_url", args.openai_url)) if v}
    overrides = {
        name: value
        for name, value in (
            ("chunked_prefill_size", args.chunked_prefill_size),
            ("decode_log_interval", args.decode_log_interval),
            ("max_total_num_tokens", args.max_total_tokens),
            ("model", args.model),
        )
        if value is not None
    }
    return WatchConfig(
        source=args.source,
        target=args.target,
        follow=args.follow,
        port=args.port,
        host=args.host,
        token=args.token,
        trace=args.trace,
        kv_events=args.kv_events,
        kv_replay=args.kv_replay,
        record_frames=args.record_frames,
        log_timezone=args.log_timezone,
        zmq_bind=args.zmq_bind,
        pace=args.pace,
        dp_rank=args.dp_rank,
        history=args.history,
        total_blocks=args.num_gpu_blocks,
        engine=engine,
        overrides=overrides,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.port is None and not args.trace:
        parser.error("nothing to do: give --port to serve, --trace to record, or both")
    if args.follow and (args.source not in LOG_SOURCES or args.target == "-"):
        parser.error("--follow tails a log file")
    if args.pace is not None and (args.source not in LOG_SOURCES or args.pace <= 0):
        parser.error("--pace replays a log: give a speed > 0")
    watch = Watch(config_from_args(args))
    previous = _stop_on_signals(watch)
    try:
        watch.run()
    except KeyboardInterrupt:  # a second Ctrl-C while stopping
        watch.stop.set()
    except (OSError, ValueError) as exc:  # a missing log, a port in use, not a frames file
        print(f"watch: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print(watch.emitter.summary_line(), file=sys.stderr, flush=True)
    return 0


def _stop_on_signals(watch: Watch) -> dict[int, Any]:
    """SIGTERM (a service manager) and SIGINT (Ctrl-C) stop the watch cleanly: the source stops,
    every message already served reaches the trace, and the trace is closed. A second signal
    interrupts at once. Only in the main thread (a watch run from a test thread keeps Python's
    own handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum: int, _frame: Any) -> None:
        if watch.stop.is_set():
            raise KeyboardInterrupt
        watch.stop.set()

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}


if __name__ == "__main__":
    sys.exit(main())
