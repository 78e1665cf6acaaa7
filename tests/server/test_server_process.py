"""The two processes of `python -m engine.server`: the engine process and the API process it
spawns (engine/server/frontend.py), and what each does when the other dies; plus the router's
rule for messages that arrive before their submit's reply."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

from engine.server.openai.api import Router, Stream
from tests.server.test_openai_api import ApiServer


def api_pid(server: ApiServer) -> int:
    """The API process: the engine process's one child."""
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("POST", path, body=json.dumps(body))
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def test_messages_before_the_submits_reply_are_held_for_it() -> None:
    async def run() -> None:
        router = Router()
        stream = Stream(asyncio.get_running_loop())
        router.expect()  # a submit is on its way
        router.sink({"type": "request", "uid": 7, "event": "queued", "t": 0.0})  # before its reply
        router.sink({"type": "request", "uid": 3, "event": "queued", "t": 0.0})  # someone else's
        router.register([7], stream)  # the reply names uid 7
        router.sink({"type": "token", "uid": 7, "t": 0.1, "token_id": 1, "text": "a"})
        got = await stream.get()
        assert [(m["uid"], m["type"]) for m in got] == [(7, "request"), (7, "token")]
        assert router._held == {}  # no submit outstanding: uid 3's message was dropped
        router.sink({"type": "request", "uid": 3, "event": "finished", "t": 0.2})
        assert router._held == {}  # nor held later

    asyncio.run(run())


def test_a_dead_engine_process_gets_503s_not_hangs(tiny_llama_dir: Path) -> None:
    # the 503s below are asked for within 2 s of the engine's death (the default grace is 5 s)
    server = ApiServer(tiny_llama_dir, "--max-running-req", "4", "--engine-gone-grace", "2")
    api = api_pid(server)
    try:
        parts = urlsplit(server.http_url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        body = {"prompt": "a b c", "max_tokens": 900, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # it is generating
        server.proc.kill()  # the engine process dies mid-stream
        rest = resp.read().decode()  # ends instead of hanging
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "the engine is not running" in json.loads(events[-2])["error"]["message"]
        status, err = post(server.http_url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and err["error"]["code"] == "engine_gone"
        health = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        health.request("GET", "/health")
        assert health.getresponse().status == 503
        deadline = time.monotonic() + 60  # it exits once its grace period is over
        while alive(api):
            assert time.monotonic() < deadline, "the API process outlived its engine"
            time.sleep(0.2)
    finally:
        server.stop()
        if alive(api):
            os.kill(api, signal.SIGKILL)


def test_the_engine_stops_when_its_api_process_dies(tiny_llama_dir: Path) -> None:
    server = ApiServer(tiny_llama_dir)
    os.kill(api_pid(server), signal.SIGKILL)
    server.proc.wait(timeout=60)  # on its own: no signal sent to it
    code, err = server.stop()
    assert code == 1 and "the API process exited (status -9)" in err
    assert "Traceback" not in err


def test_the_api_process_tokenizer_head_start_is_the_engines(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The API process loads a local model's tokenizer while the engine loads the model, and
    keeps it only if the engine names that directory (`facts.tokenizer`)."""
    import shutil

    from engine.server.frontend import _early_tokenizer

    early = _early_tokenizer(str(tiny_llama_dir))
    assert early.tokenizer is not None
    assert early.take(str(tiny_llama_dir / ".")) is early.tokenizer  # the same directory
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    elsewhere = early.take(str(other))  # the engine read another one: that one is loaded
    assert elsewhere is not early.tokenizer and elsewhere.name_or_path == str(other)
    assert _early_tokenizer("smollm2").tokenizer is None  # not a local directory: no guess
    assert _early_tokenizer(str(tmp_path / "missing")).tokenizer is None
