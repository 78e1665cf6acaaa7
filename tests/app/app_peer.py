"""A protocol peer for the dashboard's tests: a real WebSocket server that speaks docs/protocol.md.

`SimEngine` is a pure, clock-free scheduler model (prefill-first or mixed, chunked prompts, a
paged KV pool) that turns submits into plausible `step`/`token`/`request` messages. `AppPeer`
serves it on a free local port from a background thread and records every command it receives,
so a test can assert what the page sent. `synthetic_trace` makes long traces for benchmarks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.server import ServerConnection, broadcast, serve
from websockets.exceptions import ConnectionClosed

Message = dict[str, Any]
WORDS = ("the", " sea", " was", " calm", ",", " and", " Paris", " is", " a", " city", ".")
HISTORY_STEPS = 2_000


@dataclass
class SimRequest:
    uid: int
    prompt_len: int
    max_tokens: int
    computed: int = 0
    output: int = 0
    text: str = ""
    state: str = "waiting"
    t_queued: float = 0.0
    t_first_token: float | None = None
    t_finished: float | None = None

    def record(self) -> Message:
        return {
            "uid": self.uid,
            "state": self.state,
            "prompt_len": self.prompt_len,
            "cached_len": 0,
            "output_len": self.output,
            "max_tokens": self.max_tokens,
            "t_queued": self.t_queued,
            "t_first_token": self.t_first_token,
            "t_finished": self.t_finished,
            "text": self.text,
        }


class SimEngine:
    """A toy scheduler with the protocol's semantics; time advances only when it steps."""

    def __init__(
        self,
        max_extend_tokens: int = 64,
        policy: str = "prefill_first",
        num_pages: int = 4_096,
        page_size: int = 1,
    ) -> None:
        self.config = {"max_extend_tokens": max_extend_tokens, "policy": policy}
        self.num_pages = num_pages
        self.page_size = page_size
        self.now = 0.0
        self.step_no = 0
        self.cached_pages = 0
        self._uids = itertools.count()
        self.requests: dict[int, SimRequest] = {}
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []

    def submit(self, prompt_len: int, max_tokens: int) -> tuple[int, list[Message]]:
        req = SimRequest(next(self._uids), prompt_len, max_tokens, t_queued=self.now)
        self.requests[req.uid] = req
        self.waiting.append(req)
        event = {"type": "request", "uid": req.uid, "event": "queued", "t": self.now}
        return req.uid, [event | {"prompt_len": prompt_len, "max_tokens": max_tokens}]

    def abort(self, uid: int) -> list[Message] | None:
        req = self.requests.get(uid)
        if req is None or req.state not in ("waiting", "running"):
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        req.state, req.t_finished = "aborted", self.now
        return [{"type": "request", "uid": uid, "event": "aborted", "t": self.now}]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def step(self) -> list[Message]:
        """Run one engine step; returns the step message and what it caused, in protocol order."""
        if not self.busy:
            return []
        budget = int(self.config["max_extend_tokens"])
        decoding = [r for r in self.running if r.computed >= r.prompt_len]
        prefilling = [r for r in self.running if r.computed < r.prompt_len]
        items: list[Message] = []
        events: list[Message] = []
        t0 = self.now
        if self.config["policy"] == "mixed":
            items += [self._decode_item(r) for r in decoding]
            items += self._prompt_items(prefilling, budget - len(decoding), events, t0)
        else:
            items += self._prompt_items(prefilling, budget, events, t0)
            if not items:
                items += [self._decode_item(r) for r in decoding]
        if not items:
            return []
        prompt_tokens = sum(i["end"] - i["start"] for i in items if i["kind"] != "decode")
        decodes = sum(1 for i in items if i["kind"] == "decode")
        self.now = t1 = t0 + 0.02 + 0.002 * prompt_tokens + 0.004 * decodes
        kinds = {i["kind"] == "decode" for i in items}
        phase = "mixed" if len(kinds) == 2 else ("decode" if True in kinds else "prefill")
        tokens: list[Message] = []
        for item in items:
            req = self.requests[item["uid"]]
            req.computed = item["end"]
            if item["kind"] == "chunk":
                continue
            word = WORDS[req.output % len(WORDS)]
            req.output += 1
            req.text += word
            tokens.append({"type": "token", "uid": req.uid, "t": t1, "token_id": 7, "text": word})
            if req.output == 1:
                req.t_first_token = t1
                events.append({"type": "request", "uid": req.uid, "event": "first_token", "t": t1})
            if req.output >= req.max_tokens:
                req.state, req.t_finished = "finished", t1
                self.running.remove(req)
                self.cached_pages = min(
                    self.cached_pages + self._pages(req.prompt_len), self.num_pages // 4
                )
                events.append(
                    {
                        "type": "request",
                        "uid": req.uid,
                        "event": "finished",
                        "t": t1,
                        "output_len": req.output,
                        "finish_reason": "length",
                        "text": req.text,
                    }
                )
        used = sum(self._pages(r.computed) for r in self.running)
        reserved = sum(
            max(r.prompt_len - r.computed, 0) + r.max_tokens - r.output for r in self.running
        ) + sum(r.prompt_len + r.max_tokens for r in self.waiting)
        cached = min(self.cached_pages, self.num_pages - used)
        step = {
            "type": "step",
            "step": self.step_no,
            "t0": t0,
            "t1": t1,
            "phase": phase,
            "budget": budget,
            "policy": self.config["policy"],
            "items": items,
            "kv": {
                "total": self.num_pages,
                "used": used,
                "cached": cached,
                "free": self.num_pages - used - cached,
                "reserved": reserved,
            },
            "queue": {"waiting": len(self.waiting), "running": len(self.running)},
        }
        self.step_no += 1
        return [step, *tokens, *events]

    def _decode_item(self, req: SimRequest) -> Message:
        pos = req.prompt_len + req.output
        return {"uid": req.uid, "kind": "decode", "start": pos - 1, "end": pos}

    def _prompt_items(
        self, prefilling: list[SimRequest], left: int, events: list[Message], t: float
    ) -> list[Message]:
        items = []
        queue = list(prefilling)
        while left > 0 and (queue or self.waiting):
            if queue:
                req = queue.pop(0)
            else:
                req = self.waiting.popleft()
                req.state = "running"
                self.running.append(req)
                events.append(
                    {
                        "type": "request",
                        "uid": req.uid,
                        "event": "admitted",
                        "t": t,
                        "cached_len": 0,
                    }
                )
            n = min(left, req.prompt_len - req.computed)
            end = req.computed + n
            kind = "prefill" if end == req.prompt_len else "chunk"
            items.append({"uid": req.uid, "kind": kind, "start": req.computed, "end": end})
            left -= n
        return items

    def history(self, steps: list[Message]) -> Message:
        return {
            "steps": steps[-HISTORY_STEPS:],
            "requests": [r.record() for r in self.requests.values()],
        }


def synthetic_trace(num_steps: int, seed_every: int = 40) -> list[Message]:
    """A long mixed workload: chats decoding while long prompts arrive, both policies in turn."""
    sim = SimEngine(max_extend_tokens=128, num_pages=20_000)
    out: list[Message] = []
    steps = 0
    while steps < num_steps:
        if steps % seed_every == 0:
            for k in range(6):
                out += sim.submit(prompt_len=20 + 7 * k, max_tokens=60)[1]
            out += sim.submit(prompt_len=900, max_tokens=8)[1]
        if steps % 1_000 == 0:
            sim.config["policy"] = "mixed" if (steps // 1_000) % 2 else "prefill_first"
        msgs = sim.step()
        out += msgs
        steps += 1 if msgs else 0
    return out


class AppPeer:
    """`with AppPeer() as peer:` serves a `SimEngine` at `peer.url` and records commands."""

    def __init__(self, tick_s: float = 0.02, port: int = 0, **engine: Any) -> None:
        self.sim = SimEngine(**engine)
        self.tick_s = tick_s
        self.commands: list[Message] = []
        self.steps: list[Message] = []
        self.engine_info = {
            "model": "sim-peer",
            "device": "none",
            "dtype": "none",
            "vocab_size": 100,
            "page_size": self.sim.page_size,
            "num_pages": self.sim.num_pages,
            "max_running_req": 32,
            "max_seq_len": 4_096,
            "max_frame_bytes": 1 << 20,
        }
        self.port = port
        self._clients: set[ServerConnection] = set()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def __enter__(self) -> AppPeer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the protocol peer did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def received(self, kind: str) -> list[Message]:
        with self._lock:
            return [c for c in self.commands if c.get("type") == kind]

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> bool:
        """Poll `predicate()` until it is truthy; the timeout only bounds a failing test."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return bool(predicate())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with serve(self._handle, "127.0.0.1", self.port) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            ticker = asyncio.create_task(self._run_engine())
            await self._stop.wait()
            ticker.cancel()

    def _broadcast(self, msgs: list[Message]) -> None:
        for msg in msgs:
            if msg["type"] == "step":
                self.steps.append(msg)
            broadcast(self._clients, json.dumps(msg))

    async def _run_engine(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            with self._lock:
                self._broadcast(self.sim.step())

    async def _handle(self, ws: ServerConnection) -> None:
        with self._lock:
            hello = {
                "type": "hello",
                "protocol": 1,
                "now": self.sim.now,
                "engine": self.engine_info,
                "config": dict(self.sim.config),
                "history": self.sim.history(self.steps),
            }
            # A synchronous write under the lock, so no step can slip in ahead of the hello.
            broadcast([ws], json.dumps(hello))
            self._clients.add(ws)
        try:
            async for raw in ws:
                try:
                    cmd = json.loads(raw)
                except json.JSONDecodeError:
                    await ws.send(json.dumps(_error(None, "invalid_json", "not JSON")))
                    continue
                with self._lock:
                    self.commands.append(cmd)
                    reply = self._command(cmd)
                if reply is not None:
                    await ws.send(json.dumps(reply))
        except ConnectionClosed:
            pass
        finally:
            self._clients.discard(ws)

    def _command(self, cmd: Message) -> Message | None:
        cid = cmd.get("id")
        kind = cmd.get("type")
        if kind == "submit":
            prompt = cmd.get("prompt")
            max_tokens = cmd.get("max_tokens", 64)
            if not isinstance(prompt, str) or not prompt:
                return _error(cid, "invalid_request", "prompt must be a non-empty string")
            if not isinstance(max_tokens, int) or max_tokens < 1:
                return _error(cid, "invalid_request", "max_tokens must be an integer >= 1")
            prompt_len = max(1, len(prompt) // 4)
            if prompt_len + max_tokens > self.engine_info["max_seq_len"]:
                return _error(cid, "too_large", "prompt plus max_tokens exceeds max_seq_len")
            uid, msgs = self.sim.submit(prompt_len, max_tokens)
            self._broadcast(msgs)
            return {"type": "accepted", "id": cid, "uid": uid}
        if kind == "set_config":
            budget = cmd.get("max_extend_tokens", self.sim.config["max_extend_tokens"])
            policy = cmd.get("policy", self.sim.config["policy"])
            if not isinstance(budget, int) or budget < 1:
                return _error(cid, "invalid_request", "max_extend_tokens must be >= 1")
            if policy not in ("prefill_first", "mixed"):
                return _error(cid, "invalid_request", f"unknown policy {policy!r}")
            self.sim.config.update(max_extend_tokens=budget, policy=policy)
            self._broadcast([{"type": "config", "id": cid, "t": self.sim.now, **self.sim.config}])
            return None
        if kind == "abort":
            msgs = self.sim.abort(int(cmd.get("uid", -1)))
            if msgs is None:
                return _error(cid, "not_found", f"no request {cmd.get('uid')} in flight")
            self._broadcast(msgs)
            return {"type": "accepted", "id": cid, "uid": int(cmd["uid"])}  # v1.1 acknowledges
        if kind == "kv_map":  # the extension: each running request's pages, then free ones
            runs = [[self.sim._pages(r.computed), 2, r.uid, 1] for r in self.sim.running]
            runs = [r for r in runs if r[0] > 0]
            free = self.sim.num_pages - sum(r[0] for r in runs)
            return {
                "type": "kv_map",
                "id": cid,
                "t": self.sim.now,
                "num_pages": self.sim.num_pages,
                "page_size": self.sim.page_size,
                "states": ["free", "cached", "used", "shared"],
                "runs": [*runs, [free, 0, -1, 0]],
                "reserved_pages": 0,
                "reserved_tokens": 0,
            }
        return _error(cid, "unknown_type", f"unknown command type {kind!r}")


def _error(cid: str | None, code: str, message: str) -> Message:
    return {"type": "error", "id": cid, "code": code, "message": message}
