"""Run a watch: read one source, emit its steps (and KV events) until the source ends or `stop`.

A log read without `--follow` ends at the end of the file (or of standard input); a ZMQ source
ends only when stopped. When serving (`port` set) the watch keeps serving after its source ended
until stopped, so a page can still connect and draw the whole log from `hello`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from instrumentation.publisher import PublisherConfig
from instrumentation.trace import TraceWriter
from instrumentation.watch.aggregate import AggregateStep
from instrumentation.watch.emitter import HISTORY_STEPS, Emitter
from instrumentation.watch.fpm import FpmReader
from instrumentation.watch.kv_events import KvEventsReader
from instrumentation.watch.lines import read_lines
from instrumentation.watch.sglang_log import SglangLogReader
from instrumentation.watch.vllm_log import VllmLogReader
from instrumentation.watch.zmq_sub import Frames, subscribe

LOG_SOURCES = ("sglang-log", "vllm-log")
FPM_SOURCES = ("sglang-fpm", "vllm-fpm")
KV_SOURCES = ("vllm-kv-events",)
SOURCES = LOG_SOURCES + FPM_SOURCES + KV_SOURCES
IDLE_S = 1.0  # a followed log quiet this long has finished the second its last steps were in


@dataclass
class WatchConfig:
    source: str
    target: str  # a log path, "-" for stdin, or a ZMQ endpoint
    follow: bool = False
    port: int | None = None  # serve the protocol there (0: any free port)
    host: str = "127.0.0.1"
    token: str | None = None
    trace: str | None = None
    kv_events: str | None = None  # a second endpoint: KV events beside a log or FPM source
    zmq_bind: bool = False
    pace: float | None = None  # replay a log at this many times its own timestamps' speed
    dp_rank: int | None = None
    history: int = HISTORY_STEPS
    total_blocks: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # model, openai_url: into hello.engine
    overrides: dict[str, Any] = field(default_factory=dict)  # figures the log may lack


class Watch:
    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.emitter = Emitter(
            {"source": config.source, **config.engine}, history_steps=config.history
        )
        self.stop = threading.Event()
        self.served = threading.Event()  # set once serving (tests read `url` then)
        self.url: str | None = None
        self._threads: list[threading.Thread] = []
        self._writer: TraceWriter | None = None

    def run(self) -> None:
        cfg = self.config
        if cfg.trace:
            self._writer = TraceWriter(cfg.trace)
            self.emitter.add_trace(self._writer)
        try:
            if cfg.port is not None:
                publisher = self.emitter.serve(
                    PublisherConfig(host=cfg.host, port=cfg.port, token=cfg.token)
                )
                self.url = publisher.url
                print(f"watch: serving {self.url}", file=sys.stderr, flush=True)
            self.served.set()
            if cfg.kv_events and cfg.source not in KV_SOURCES:
                self._background(lambda: self._zmq(cfg.kv_events or "", self._kv_handler()))
            self._read_source()
            if cfg.port is not None:
                self.stop.wait()  # keep serving the history until stopped
        finally:
            self.stop.set()
            self.served.set()
            for t in self._threads:
                t.join(timeout=5)
            self.emitter.stop()
            if self._writer is not None:
                self._writer.close()

    def _read_source(self) -> None:
        cfg, em = self.config, self.emitter
        if cfg.source in LOG_SOURCES:
            reader: Any
            if cfg.source == "sglang-log":
                reader = SglangLogReader(
                    em.engine, em.status, em.now, overrides=cfg.overrides, dp_rank=cfg.dp_rank
                )
            else:
                reader = VllmLogReader(em.engine, em.status, em.now, dp_rank=cfg.dp_rank)
            pacer = _Pacer(cfg.pace) if cfg.pace else None
            lines = read_lines(cfg.target, follow=cfg.follow, stop=self.stop, idle_s=IDLE_S)
            for line in lines:
                # None: the log went quiet, so the steps held in their second are final
                steps = reader.flush() if line is None else reader.feed(line)
                if pacer is not None and steps and pacer.wait(steps[0], self.stop):
                    break
                self._emit_steps(steps)
                if self.stop.is_set():
                    break
            self._emit_steps(reader.flush())  # the end of the input (or stopped): all are final
        elif cfg.source in FPM_SOURCES:
            fpm = FpmReader(cfg.source, em.engine, em.status, em.now)
            self._zmq(cfg.target, lambda frames: self._emit_steps(fpm.feed(frames)))
        else:
            self._zmq(cfg.target, self._kv_handler())

    def _emit_steps(self, steps: list[AggregateStep]) -> None:
        for step in steps:
            self.emitter.step(step)

    def _kv_handler(self) -> Callable[[Frames], None]:
        reader = KvEventsReader(self.emitter.status, self.emitter.now, self.config.total_blocks)

        def handle(frames: Frames) -> None:
            fields = reader.feed(frames)
            if fields is not None:
                self.emitter.broadcast({"type": "kv_events", **fields})

        return handle

    def _zmq(self, endpoint: str, handle: Callable[[Frames], None]) -> None:
        subscribe(endpoint, handle, self.stop, bind=self.config.zmq_bind)

    def _background(self, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name="watch-kv-events", daemon=True)
        t.start()
        self._threads.append(t)


class _Pacer:
    """Holds each step back until its log time, scaled by `speed`, has passed since the first:
    a recorded log replays as it happened (or faster), so the page draws it growing."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self.first: float | None = None
        self.start = time.monotonic()

    def wait(self, step: AggregateStep, stop: threading.Event) -> bool:
        """True when stopped while waiting."""
        if step.t_source == "received":
            return stop.is_set()
        if self.first is None:
            self.first = step.t1
        delay = (step.t1 - self.first) / self.speed - (time.monotonic() - self.start)
        return stop.wait(delay) if delay > 0 else stop.is_set()
