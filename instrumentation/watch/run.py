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
from instrumentation.watch.frames import FrameRecorder, is_frames_file, read_frames
from instrumentation.watch.kv_events import KvEventsReader
from instrumentation.watch.lines import read_lines
from instrumentation.watch.sglang_log import SglangLogReader
from instrumentation.watch.vllm_log import VllmLogReader
from instrumentation.watch.zmq_sub import Frames, replay, subscribe

LOG_SOURCES = ("sglang-log", "vllm-log")
FPM_SOURCES = ("sglang-fpm", "vllm-fpm")
KV_SOURCES = ("vllm-kv-events",)
SOURCES = LOG_SOURCES + FPM_SOURCES + KV_SOURCES
IDLE_S = 1.0  # a followed log quiet this long has finished the second its last steps were in


@dataclass
class WatchConfig:
    source: str
    target: str  # a log path, "-" for stdin, or a ZMQ endpoint (a frames file for KV events)
    follow: bool = False
    port: int | None = None  # serve the protocol there (0: any free port)
    host: str = "127.0.0.1"
    token: str | None = None
    trace: str | None = None
    kv_events: str | None = None  # a second endpoint (or frames file): KV events beside a source
    kv_replay: str | None = None  # vLLM's KV-event replay endpoint: missed batches asked for
    record_frames: str | None = None  # keep the KV-event socket's raw messages in this file
    zmq_bind: bool = False
    pace: float | None = None  # replay a log at this many times its own timestamps' speed
    dp_rank: int | None = None
    history: int = HISTORY_STEPS
    total_blocks: int | None = None
    log_timezone: str | None = None  # the engine's zone, for its log stamps (default: local)
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
        self._recorder: FrameRecorder | None = None
        self._log_reader: SglangLogReader | VllmLogReader | None = None

    def run(self) -> None:
        cfg = self.config
        if cfg.trace:
            self._writer = TraceWriter(cfg.trace)
            self.emitter.add_trace(self._writer)
        if cfg.record_frames:
            self._recorder = FrameRecorder(cfg.record_frames)
        try:
            if cfg.port is not None:
                publisher = self.emitter.serve(
                    PublisherConfig(host=cfg.host, port=cfg.port, token=cfg.token)
                )
                self.url = publisher.url
                print(f"watch: serving {self.url}", file=sys.stderr, flush=True)
            self.served.set()
            kv_file = cfg.kv_events is not None and is_frames_file(cfg.kv_events)
            if cfg.kv_events and cfg.source not in KV_SOURCES and not kv_file:
                self._background(lambda: self._zmq(cfg.kv_events or "", self._kv_handler()))
            self._read_source()
            if kv_file and cfg.source not in KV_SOURCES:
                # A recorded capture: its events after its log, so every batch finds the log's
                # clock (the events' `ts` is placed on it).
                self._replay_frames(cfg.kv_events or "", self._kv_handler())
            if cfg.port is not None:
                self.stop.wait()  # keep serving the history until stopped
        finally:
            self.stop.set()
            self.served.set()
            for t in self._threads:
                t.join(timeout=5)
            self.emitter.stop()  # the publisher hands every message it was given to the trace
            if self._writer is not None:
                self._writer.close()
            if self._recorder is not None:
                self._recorder.close()

    def _read_source(self) -> None:
        cfg, em = self.config, self.emitter
        if cfg.source in LOG_SOURCES:
            reader: SglangLogReader | VllmLogReader
            if cfg.source == "sglang-log":
                reader = SglangLogReader(
                    em.engine, em.status, em.now, overrides=cfg.overrides, dp_rank=cfg.dp_rank
                )
            else:
                reader = VllmLogReader(em.engine, em.status, em.now, dp_rank=cfg.dp_rank)
            self._log_reader = reader
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
        elif is_frames_file(cfg.target):
            self._replay_frames(cfg.target, self._kv_handler())
        else:
            self._zmq(cfg.target, self._kv_handler())

    def _emit_steps(self, steps: list[AggregateStep]) -> None:
        for step in steps:
            self.emitter.step(step)

    def _kv_handler(self) -> Callable[[Frames], None]:
        cfg = self.config
        replay_endpoint = cfg.kv_replay
        reader = KvEventsReader(
            self.emitter.status,
            self.emitter.now,
            cfg.total_blocks,
            replay=(lambda start: replay(replay_endpoint, start)) if replay_endpoint else None,
            time_of=self._engine_time,
        )

        def handle(frames: Frames) -> None:
            if self._recorder is not None:
                self._recorder.write(frames)
            for fields in reader.feed(frames):
                self.emitter.broadcast({"type": "kv_events", **fields})

        return handle

    def _engine_time(self, ts: float) -> float | None:
        """A KV batch's engine wall-clock time on the log's clock (the steps' axis); None
        without a log or before its first stamped line."""
        if self._log_reader is None:
            return None
        return self._log_reader.clock.at_epoch(ts, self.config.log_timezone)

    def _replay_frames(self, path: str, handle: Callable[[Frames], None]) -> None:
        for _, frames in read_frames(path):
            if self.stop.is_set():
                return
            handle(frames)

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
