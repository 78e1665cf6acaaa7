"""The server's command line, generated from its settings: the engine's (`EngineConfig`) and the
server's own (ports, token, queues, trace), so `--help`, `LLM(...)` and the defaults agree."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine.config import EngineConfig, add_arguments, from_args, setting
from instrumentation.errors import InvalidRequest
from instrumentation.publisher import is_loopback

TOKEN_ENV = "STEPSCOPE_TOKEN"
METRICS_TOKEN_ENV = "STEPSCOPE_METRICS_TOKEN"


def http_port(text: str) -> int | None:
    if text.lower() == "none":
        return None
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] or 'none', got {text}")
    return value


def tcp_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {text}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


@dataclass(frozen=True)
class ServerArgs(EngineConfig):
    """The engine's settings and the server's: what `python -m engine.server` is started with."""

    host: str = setting("127.0.0.1", "bind address; non-loopback needs --token")
    port: int = setting(
        8765, "the WebSocket port; 0 picks a free one (printed when ready)", minimum=0,
        parse=tcp_port,
    )  # fmt: skip
    token: str | None = setting(
        None, f"clients must present it (?token= or Authorization: Bearer); env {TOKEN_ENV}"
    )
    allow_origin: tuple[str, ...] = setting(
        (), "a browser origin allowed besides localhost ones", metavar="ORIGIN"
    )
    http_port: int | None = setting(
        8000,
        "the OpenAI-compatible API and /metrics, on --host; 0 picks a free port (printed when "
        "ready), 'none' turns it off",
        minimum=0,
        parse=http_port,
    )
    threads: int | None = setting(
        None, "torch CPU threads (default: torch's choice); 1 avoids stalls on a busy machine"
    )
    max_waiting: int = setting(1024, "waiting requests before `capacity`")
    history_steps: int = setting(2000, "step messages kept for hello")
    client_queue: int = setting(4096, "messages buffered per client")
    client_drop_limit: int = setting(
        16384, "messages a client may lose without catching up before it is disconnected"
    )
    client_socket_buffer: int | None = setting(
        None, "the kernel's send buffer per client, in bytes (default: the OS's, which grows to "
        "megabytes); smaller, a client that falls behind loses its oldest messages sooner "
        "instead of receiving them late", metavar="BYTES",
    )  # fmt: skip
    engine_gone_grace: float = setting(
        5.0, "seconds the API process answers 503 after the engine process died, before it "
        "exits with status 1", parse=seconds, metavar="SECONDS",
    )  # fmt: skip
    trace: str | None = setting(
        None, "write every published message to FILE as JSON lines", metavar="FILE"
    )
    metrics_token: str | None = setting(
        None, "/metrics needs it as a Bearer token (default: /metrics is open, as vLLM's "
        f"--api-key guards only /v1); env {METRICS_TOKEN_ENV}",
    )  # fmt: skip
    metrics_compat: str | None = setting(
        None, "also export vLLM's metric names (vllm:), labels and buckets, so vLLM's Grafana "
        "dashboards work unchanged", choices=("vllm",), noun="metrics compat",
    )  # fmt: skip
    delays: bool = setting(
        True, "name who delayed each request (instrumentation.delay): the `delay` of its end "
        "event and /metrics' delay series; --no-delays leaves both out",
    )  # fmt: skip
    generation_config: str = setting(
        "auto", "auto: the model's generation_config.json sampling defaults apply to requests "
        "that leave a field out; vllm: OpenAI's defaults (vLLM's switch)",
        choices=("auto", "vllm"), noun="generation config",
    )  # fmt: skip

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        for name in ("port", "http_port"):
            v = getattr(self, name)
            if v is not None and v > 65535:
                raise InvalidRequest(f"{name} must be in [0, 65535], got {v}")
        if not is_loopback(self.host) and not self.token:
            raise InvalidRequest(
                f"--host {self.host} is not loopback: give --token so strangers can't connect"
            )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.server",
        description="Run the stepscope engine behind a WebSocket (see docs/protocol.md).",
    )
    add_arguments(p, ServerArgs)
    p.set_defaults(token=os.environ.get(TOKEN_ENV), metrics_token=os.environ.get(METRICS_TOKEN_ENV))
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """The command line as `ServerArgs`; a bad value exits with argparse's usage error."""
    parser = build_parser()
    try:
        return from_args(ServerArgs, parser.parse_args(argv))
    except InvalidRequest as exc:
        parser.error(str(exc))
