"""Traces: a JSON-lines writer for every published message, and its Chrome trace conversion.

`python -m instrumentation.trace IN.jsonl OUT.json` turns a recorded session into Chrome's trace
event format (Perfetto, chrome://tracing): one track of engine steps with KV and queue counters,
and one track per request with its waiting time, chunk, prefill and decode slices, its stalls
and its metrics, all as the shared fold (instrumentation.fold) defines them. Pure Python: no
torch, so the dashboard can offer the same export.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from instrumentation.fold import Fold, stalls

Message = dict[str, Any]
ENGINE_PID = 1
REQUESTS_PID = 2
STEPS_TID = 1
_US = 1e6  # Chrome traces count microseconds


class TraceWriter:
    """A publisher sink that appends each message's JSON text as one line.

    Each line is written whole and flushed to the operating system at once, so a process stopped
    at any moment (SIGTERM from a service manager, SIGKILL, a crash) leaves every message it had
    served in the file, with at most a cut last line that `read_jsonl` skips."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("w", encoding="utf-8")
        self.lines = 0

    def __call__(self, msg: Message, text: str) -> None:
        self.write(text)

    def write(self, text: str) -> None:
        if self._file.closed:  # a message after close (shutting down): dropped, never a crash
            return
        self._file.write(text + "\n")
        self._file.flush()
        self.lines += 1

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def parse_lines(lines: Iterable[str]) -> Iterator[Message]:
    """Messages of JSON lines; blank and broken lines (a writer killed mid-line) are skipped."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict):
            yield msg


def read_jsonl(path: str | Path) -> Iterator[Message]:
    """Messages of a JSON-lines file; a truncated last line (killed writer) is skipped."""
    with Path(path).open(encoding="utf-8") as f:
        yield from parse_lines(f)


class _ChromeTrace:
    def __init__(self) -> None:
        self.events: list[Message] = []
        self.requests: set[int] = set()
        self.waiting: set[int] = set()  # queued, not yet in a step
        self.steps = 0
        self.engine_name = "engine"
        # with its own delay ledger: a recording made before `delay` (v1.5) gets it too
        self.fold = Fold(max_steps=None, max_ended=2**62, max_ended_bytes=2**62, delays=True)

    def add(self, msg: Message) -> None:
        kind = msg.get("type")
        self.fold.apply(msg)
        if kind == "hello":
            self.engine_name = f"engine: {msg.get('engine', {}).get('model', '?')}"
            for step in msg.get("history", {}).get("steps", []):
                self._step(step)
        elif kind == "step":
            self._step(msg)
        elif kind == "request":
            self._request(msg)
        elif kind == "config":
            args = {k: v for k, v in msg.items() if k not in ("type", "t")}
            self.events.append(_instant("set_config", msg["t"], ENGINE_PID, STEPS_TID, args, "g"))

    def _step(self, msg: Message) -> None:
        t0, t1 = msg["t0"], msg["t1"]
        items = msg.get("items", [])
        prompt = sum(i["end"] - i["start"] for i in items if i["kind"] != "decode")
        decodes = sum(1 for i in items if i["kind"] == "decode")
        args = {
            "step": msg["step"],
            "budget": msg.get("budget"),
            "policy": msg.get("policy"),
            "prompt_tokens": prompt,
            "decodes": decodes,
            "requests": len(items),
        }
        name = f"{msg.get('phase', 'step')} #{msg['step']}"
        self.events.append(_slice(name, "step", t0, t1, ENGINE_PID, STEPS_TID, args))
        if "kv" in msg:
            kv = {k: msg["kv"][k] for k in ("used", "cached", "free") if k in msg["kv"]}
            self.events.append(_counter("kv pages", t1, kv))
            self.events.append(
                _counter("kv reserved tokens", t1, {"reserved": msg["kv"].get("reserved", 0)})
            )
        if "queue" in msg:
            self.events.append(_counter("queue", t1, dict(msg["queue"])))
        self.events.append(_counter("tokens", t0, {"prompt": prompt, "decode": decodes}))
        for item in items:
            uid = item["uid"]
            self._close_waiting(uid, t0)
            self.requests.add(uid)
            label = (
                "decode"
                if item["kind"] == "decode"
                else f"{item['kind']} [{item['start']}:{item['end']})"
            )
            item_args = {"step": msg["step"], "start": item["start"], "end": item["end"]}
            cat = item["kind"]
            if item.get("wasted"):  # the request ended while this step ran
                label, cat, item_args["wasted"] = f"wasted {label}", "wasted", True
            self.events.append(_slice(label, cat, t0, t1, REQUESTS_PID, uid, item_args))
        self.steps += 1

    def _request(self, msg: Message) -> None:
        uid, event, t = msg["uid"], msg["event"], msg["t"]
        self.requests.add(uid)
        args = {k: v for k, v in msg.items() if k not in ("type", "uid", "event", "t")}
        if event == "queued":
            self.waiting.add(uid)
        elif event in ("aborted", "rejected", "finished"):
            self._close_waiting(uid, t)
            rec = self.fold.get(uid)
            metrics = rec.metrics() if rec is not None else None
            if metrics:  # the fold's figures, as the page and the summary compute them
                args.update({k: v for k, v in metrics.items() if not isinstance(v, list)})
            if rec is not None and rec.delay is not None:
                args["delay"] = rec.delay.to_dict()
        if event != "queued":
            self.events.append(_instant(event, t, REQUESTS_PID, uid, args, "t"))

    def _close_waiting(self, uid: int, t: float) -> None:
        # Ends at the first step that lists the request, so slices on its track never overlap.
        if uid not in self.waiting:
            return
        self.waiting.discard(uid)
        rec = self.fold.get(uid)
        start = rec.t_queued if rec is not None else None
        if start is not None:
            self.events.append(
                _slice("waiting", "waiting", start, max(start, t), REQUESTS_PID, uid, {})
            )

    def _stalls(self) -> None:
        steps = list(self.fold.steps)
        running = [r.uid for r in self.fold.live_requests() if r.state == "running"]
        for st in stalls(steps, running):
            # from the end of its last step with a token to the start of its next one
            t0 = steps[st.first - 1]["t1"] if st.first > 0 else steps[st.first]["t0"]
            t1 = steps[st.last]["t1"]
            args = {"steps": [steps[st.first]["step"], steps[st.last]["step"]],
                    "seconds": st.seconds, "ongoing": st.ongoing}  # fmt: skip
            self.events.append(_slice("stall", "stall", t0, t1, REQUESTS_PID, st.uid, args))

    def result(self) -> Message:
        self._stalls()
        meta = [
            _meta("process_name", ENGINE_PID, 0, {"name": self.engine_name}),
            _meta("process_sort_index", ENGINE_PID, 0, {"sort_index": 0}),
            _meta("thread_name", ENGINE_PID, STEPS_TID, {"name": "engine steps"}),
            _meta("process_name", REQUESTS_PID, 0, {"name": "requests"}),
            _meta("process_sort_index", REQUESTS_PID, 0, {"sort_index": 1}),
        ]
        for uid in sorted(self.requests):
            meta.append(_meta("thread_name", REQUESTS_PID, uid, {"name": f"request {uid}"}))
            meta.append(_meta("thread_sort_index", REQUESTS_PID, uid, {"sort_index": uid}))
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}


def to_chrome_trace(messages: Iterable[Message]) -> Message:
    """Protocol messages (a trace file, or what a client received) → a Chrome trace object."""
    trace = _ChromeTrace()
    for msg in messages:
        trace.add(msg)
    return trace.result()


def convert(src: str | Path, dst: str | Path) -> Message:
    trace = to_chrome_trace(read_jsonl(src))
    with Path(dst).open("w", encoding="utf-8") as f:
        json.dump(trace, f)
    return trace


def _slice(name: str, cat: str, t0: float, t1: float, pid: int, tid: int, args: Message) -> Message:
    return {
        "name": name, "cat": cat, "ph": "X", "ts": t0 * _US, "dur": max(0.0, t1 - t0) * _US,
        "pid": pid, "tid": tid, "args": args,
    }  # fmt: skip


def _instant(name: str, t: float, pid: int, tid: int, args: Message, scope: str) -> Message:
    return {
        "name": name,
        "ph": "i",
        "s": scope,
        "ts": t * _US,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _counter(name: str, t: float, values: Message) -> Message:
    return {
        "name": name,
        "ph": "C",
        "ts": t * _US,
        "pid": ENGINE_PID,
        "tid": STEPS_TID,
        "args": values,
    }


def _meta(name: str, pid: int, tid: int, args: Message) -> Message:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m instrumentation.trace",
        description="Convert a stepscope JSON-lines trace (--trace) to Chrome trace format.",
    )
    parser.add_argument("src", help="JSON-lines file written by `python -m engine.server --trace`")
    parser.add_argument("dst", help="Chrome trace JSON to write (open it in ui.perfetto.dev)")
    args = parser.parse_args(argv)
    try:
        trace = convert(args.src, args.dst)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    slices = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"wrote {args.dst}: {slices} slices in {len(trace['traceEvents'])} events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
