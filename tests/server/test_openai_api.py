"""The OpenAI-compatible HTTP API, end to end: the official `openai` client against a real
`python -m engine.server` subprocess on the tiny random Llama, checked against the same prompts
submitted over the WebSocket. Plus the request parsing and stop-string matching on their own.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import InvalidStatus

from engine.detokenizer import StopMatcher
from engine.server.openai.schema import ApiError, parse_request
from tests.server.test_server_support import MAX_RUNNING, MAX_WAITING, ApiServer, stop

# One xdist worker runs this module and test_server, so the server they share is set up once
# (tests spread over both workers had each worker set up its own).
pytestmark = pytest.mark.xdist_group("shared_server")


def start(model: Path, *extra: str) -> ApiServer:
    return ApiServer(
        model, "--max-running-req", str(MAX_RUNNING), "--max-waiting", str(MAX_WAITING), *extra
    )


@pytest.fixture(scope="module")
def server(shared_server: ApiServer) -> ApiServer:
    """The server test_server's synchronous-engine runs use too (tests/server/conftest.py): one
    start fewer."""
    return shared_server


@pytest.fixture
def client(server: ApiServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def words(seed: int, n: int = 12) -> str:
    rng = random.Random(seed)
    pool = ["river", "stone", "light", "quiet", "seven", "paper", "north", "glass", "bread"]
    return " ".join(rng.choice(pool) for _ in range(n))


def ws_generate(server: ApiServer, **fields: Any) -> dict[str, Any]:
    """The same request over the WebSocket: its `queued` and `finished` events."""
    c = server.client()
    try:
        reply = c.reply({"type": "submit", "id": "ws", **fields})
        assert reply["type"] == "accepted", reply
        uid = reply["uid"]
        queued = c.until(lambda m: m.get("uid") == uid and m.get("event") == "queued")
        done = c.until(lambda m: m.get("uid") == uid and m.get("event") == "finished")
        return {"queued": queued, "finished": done}
    finally:
        c.close()


def raw(server: ApiServer, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any] | str]:  # fmt: skip
    parts = urlsplit(server.http_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json",
                                                       **(headers or {})})  # fmt: skip
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text
    finally:
        conn.close()


def scrape(server: ApiServer, auth: str = "") -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser: name{labels} → value."""
    status, text = raw(server, "GET", "/metrics", headers={"Authorization": f"Bearer {auth}"})
    assert status == 200 and isinstance(text, str)
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


# -- the API against the WebSocket ----------------------------------------------------------


def test_models_and_health(server: ApiServer, client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_llama_dir.name]
    # the --model argument is accepted as a name too
    out = client.completions.create(model=str(tiny_llama_dir), prompt="hi", max_tokens=1)
    assert out.usage.completion_tokens == 1
    status, _ = raw(server, "GET", "/health")
    assert status == 200


def test_completion_matches_the_websocket(
    server: ApiServer, client: openai.OpenAI, model: str
) -> None:
    prompt = words(1)
    ws = ws_generate(server, prompt=prompt, max_tokens=8, ignore_eos=True)
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == ws["finished"]["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == ws["finished"]["output_len"] == 8
    assert out.usage.prompt_tokens == ws["queued"]["prompt_len"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8

    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ws["finished"]["text"]
    # one chunk per token (a client that times chunks times tokens), then the finish chunk
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason is None) == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == ws["queued"]["prompt_len"]


def test_chat_matches_the_websocket(server: ApiServer, client: openai.OpenAI, model: str) -> None:
    prompt = words(2)
    ws = ws_generate(server, prompt=prompt, chat=True, max_tokens=6, ignore_eos=True)
    expected = ws["finished"]["text"]
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}],
        max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == ws["queued"]["prompt_len"]
    assert out.usage.completion_tokens == 6

    # content as a list of text parts, streamed, with usage on every chunk
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6


def test_a_whole_conversation_uses_the_chat_template(
    client: openai.OpenAI, model: str, tiny_llama_dir: Path
) -> None:
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Again"},
    ]
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = len(tok.encode(text, add_special_tokens=False))
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert out.usage.prompt_tokens == expected


def test_stop_strings_cut_the_text_and_end_the_request(
    server: ApiServer, client: openai.OpenAI, model: str
) -> None:
    prompt = words(3)
    full = (
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = full[: full.index(stop)]
    for stream in (False, True):
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
            stream=stream, extra_body={"ignore_eos": True},
        )  # fmt: skip
        if stream:
            chunks = [c for c in out if c.choices]  # type: ignore[union-attr]
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason  # type: ignore[union-attr]
        assert (text, reason) == (cut, "stop")
    assert_idle(server)


def test_sixteen_concurrent_streams(server: ApiServer, client: openai.OpenAI, model: str) -> None:
    prompts = [words(100 + i, n=5 + i) for i in range(16)]

    def solo(prompt: str) -> str:
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip

    def streamed(prompt: str) -> tuple[str, int]:
        chunks = list(
            client.completions.create(
                model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[
            -1
        ].usage.completion_tokens

    expected = [solo(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(streamed, prompts))
    assert got == [(e, 6) for e in expected]
    assert_idle(server)


# -- bad input ------------------------------------------------------------------------------


def test_bad_input_gets_4xx_and_the_server_keeps_serving(
    server: ApiServer, client: openai.OpenAI, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    assert bad.value.status_code == 400 and "max_tokens" in str(bad.value)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    long_prompt = "seven rivers " * 1000  # far beyond the tiny model's 1024 positions
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as too_long:
            client.completions.create(model=model, prompt=long_prompt, max_tokens=2, stream=stream)
        assert too_long.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", temperature=-1)

    cases: list[tuple[str, bytes, int]] = [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": NaN}', 400),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": true}', 400),
        ("/v1/completions", b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400),
        ("/v1/completions", b'{"prompt": "hi", "logprobs": 21}', 400),
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}', 400),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"1": 5}}', 400),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400),
        ("/v1/completions", b'{"prompt": [], "max_tokens": 1}', 400),
        ("/v1/completions", b'{"prompt": [99999999], "max_tokens": 1}', 400),
        ("/v1/completions", json.dumps({"prompt": "x" * (2**20 + 10)}).encode(), 413),
        ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400),
    ]  # fmt: skip
    for path, body, want in cases:
        status, reply = raw(server, "POST", path, body)
        assert status == want, (body[:80], reply)
        assert isinstance(reply, dict) and set(reply["error"]) >= {"message", "type", "code"}
    status, reply = raw(server, "GET", "/v1/nothing")
    assert status == 404 and isinstance(reply, dict) and "error" in reply
    status, reply = raw(server, "GET", "/v1/completions")
    assert status == 405 and isinstance(reply, dict) and "error" in reply

    out = client.completions.create(model=model, prompt="still here", max_tokens=3)
    assert out.usage.completion_tokens <= 3 and out.choices[0].finish_reason in ("length", "stop")


# -- logprobs, echo, n: against the model's own logits (Hugging Face, same weights) ----------


def hf_logprobs(model_dir: Path, ids: list[int]) -> Any:
    """log_softmax of Hugging Face's logits at every position of `ids` (float32)."""
    import torch

    from tests.helpers import _hf_model

    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def tid(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.split(":", 1)[1])


def check_position(
    ref: Any, pos: int, token: int, logprob: float, top: dict[str, float], k: int
) -> None:
    """The logprob of `token` predicted at `pos`, and the top `k` alternatives beside it (a
    completion's top dict holds the chosen token plus the top k), are the model's."""
    assert logprob == pytest.approx(ref[pos, token].item(), abs=2e-3)
    assert f"token_id:{token}" in top
    for t in ref[pos].topk(k).indices.tolist():
        assert f"token_id:{t}" in top
    for key, value in top.items():
        assert value == pytest.approx(ref[pos, tid(key)].item(), abs=2e-3)


def test_completion_logprobs_echo_and_n_are_the_models(
    server: ApiServer, client: openai.OpenAI, model: str, tiny_llama_dir: Path
) -> None:
    prompt = words(31, 9)
    prompt_ids = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, echo=True, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    ).choices[0].logprobs.tokens[:-1]  # fmt: skip
    ids = [tid(t) for t in prompt_ids]
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=5, n=2, echo=True, logprobs=3, temperature=1.0,
        seed=2**64 - 1, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10
    outputs = []
    for choice in out.choices:
        lp = choice.logprobs
        assert choice.text.startswith(prompt)  # echo: the prompt's text, then the output
        assert len(lp.tokens) == len(ids) + 5 and [tid(t) for t in lp.tokens[: len(ids)]] == ids
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        full = [tid(t) for t in lp.tokens]
        ref = hf_logprobs(tiny_llama_dir, full)
        for i in range(1, len(full)):  # prompt and output tokens alike
            assert len(lp.top_logprobs[i]) in (3, 4)
            check_position(ref, i - 1, full[i], lp.token_logprobs[i], lp.top_logprobs[i], 3)
        outputs.append(full[len(ids) :])
    assert outputs[0] != outputs[1]  # seed, seed + 1: two samples, not one twice
    again = client.completions.create(
        model=model, prompt=prompt, max_tokens=5, n=2, logprobs=0, temperature=1.0,
        seed=2**64 - 1, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert [[tid(t) for t in c.logprobs.tokens] for c in again.choices] == outputs


def test_chat_logprobs_and_n_are_the_models(
    server: ApiServer, client: openai.OpenAI, model: str, tiny_llama_dir: Path
) -> None:
    messages = [{"role": "user", "content": words(32, 6)}]
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, n=2, logprobs=True, top_logprobs=2,
        temperature=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    assert out.usage.prompt_tokens == len(prompt)
    got = []
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        full = prompt + [tid(e.token) for e in content]
        ref = hf_logprobs(tiny_llama_dir, full)
        for i, e in enumerate(content):
            pos = len(prompt) + i - 1
            assert e.logprob == pytest.approx(ref[pos, full[pos + 1]].item(), abs=2e-3)
            assert [tid(t.token) for t in e.top_logprobs] == ref[pos].topk(2).indices.tolist()
            assert e.bytes == list(e.token.encode())
        got.append(full[len(prompt) :])
    assert got[0] == got[1]  # greedy, twice


def test_streamed_logprobs_are_the_whole_responses(
    server: ApiServer, client: openai.OpenAI, model: str
) -> None:
    prompt = words(33, 7)
    kw: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 6, "logprobs": 2,
                          "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**kw).choices[0]
    tokens, lps, offsets, text = [], [], [], ""
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)


def test_batched_prompts_and_n_stream_every_choice_by_index(
    server: ApiServer, client: openai.OpenAI, model: str
) -> None:
    prompts = [words(35, 5), words(36, 9)]
    kw: dict[str, Any] = {"model": model, "max_tokens": 5, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}  # fmt: skip
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    whole = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert whole.usage.completion_tokens == 20
    texts = ["", "", "", ""]
    reasons: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert reasons == {0: "length", 1: "length", 2: "length", 3: "length"}
    # echo without logprobs: the prompt's text, then the output
    echoed = client.completions.create(prompt=prompts[0], echo=True, **kw).choices[0].text
    assert echoed == prompts[0] + alone[0]


def test_defaults_min_p_seed_and_stop_strings(
    server: ApiServer, client: openai.OpenAI, model: str
) -> None:
    prompt = words(34, 8)
    # max_tokens left out: 16 on /v1/completions, as OpenAI's and vLLM's
    out = client.completions.create(model=model, prompt=prompt, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    greedy = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    # min_p = 1 keeps only the likeliest token: sampling at any temperature is greedy
    only_top = client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=1.5, seed=-(2**63),
        extra_body={"ignore_eos": True, "min_p": 1.0},
    )  # fmt: skip
    assert only_top.choices[0].text == greedy.choices[0].text
    text = greedy.choices[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip()
    for include in (False, True):
        cut = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
            extra_body={"ignore_eos": True, "include_stop_str_in_output": include},
        )  # fmt: skip
        want = text[: text.index(stop) + (len(stop) if include else 0)]
        assert cut.choices[0].text == want and cut.choices[0].finish_reason == "stop"


# -- disconnects ----------------------------------------------------------------------------


def open_stream(server: ApiServer, body: dict[str, Any], auth: str = "") -> socket.socket:
    """POST a streamed request on a raw socket (so the test decides when to hang up)."""
    parts = urlsplit(server.http_url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    data = json.dumps(body).encode()
    head = f"Authorization: Bearer {auth}\r\n" if auth else ""
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data
    )  # fmt: skip
    return sock


def read_events(sock: socket.socket, n: int) -> bytes:
    got = b""
    while got.count(b"data: ") < n:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


def stream_then_hang_up(server: ApiServer, body: dict[str, Any], n_events: int) -> int:
    """Stream a request, read some events, hang up; returns the request's uid."""
    sock = open_stream(server, body)
    got = read_events(sock, n_events)
    sock.close()
    first = got.split(b"data: ", 1)[1].split(b"\n", 1)[0]
    return int(json.loads(first)["id"].split("-")[1])


def assert_idle(server: ApiServer, timeout: float = 60.0, **client: Any) -> dict[str, Any]:
    """No request running or waiting, no KV page held, page accounting intact."""
    c = server.client(**client)
    try:
        deadline = time.monotonic() + timeout
        while True:
            stats = c.stats()
            queue = (stats["queue"]["waiting"], stats["queue"]["running"])
            idle = queue == (0, 0) and stats["kv"]["used"] == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert stats["integrity"] == "ok", stats
        assert queue == (0, 0), stats
        assert stats["kv"]["used"] == 0, stats
        return stats
    finally:
        c.close()


def test_a_client_that_hangs_up_mid_stream_aborts_its_request(
    server: ApiServer, model: str
) -> None:
    watcher = server.client()
    body = {"model": model, "prompt": words(4), "max_tokens": 900, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip
    uid = stream_then_hang_up(server, body, n_events=3)
    ended = watcher.until(
        lambda m: m.get("uid") == uid and m.get("event") in ("aborted", "finished")
    )
    assert ended["event"] == "aborted" and ended["output_len"] < 900
    queued = next(m for m in watcher.seen if m.get("uid") == uid and m.get("event") == "queued")
    assert queued["source"] == "http"
    watcher.close()
    deadline = time.monotonic() + 30
    while scrape(server)["stepscope:num_requests_running{}"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert assert_idle(server)["kv"]["used"] == 0


def test_a_client_that_hangs_up_while_waiting_for_a_whole_answer_aborts_it(
    server: ApiServer, model: str
) -> None:
    watcher = server.client()
    parts = urlsplit(server.http_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=1.0)
    body = {"model": model, "prompt": words(5), "max_tokens": 900, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    queued = watcher.until(lambda m: m.get("event") == "queued" and m.get("source") == "http")
    conn.close()  # gives up before the answer
    ended = watcher.until(
        lambda m: m.get("uid") == queued["uid"] and m.get("event") in ("aborted", "finished")
    )
    assert ended["event"] == "aborted"
    watcher.close()
    assert_idle(server)


# -- /metrics -------------------------------------------------------------------------------


def test_metrics_count_what_the_clients_received(
    server: ApiServer, client: openai.OpenAI, model: str
) -> None:
    assert_idle(server)
    before = scrape(server)
    received = prompt_tokens = 0
    for i in range(4):
        kwargs: dict[str, Any] = dict(model=model, prompt=words(200 + i), max_tokens=3 + i,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        if i % 2:
            chunks = list(
                client.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
            )
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(**kwargs).usage
        received += usage.completion_tokens
        prompt_tokens += usage.prompt_tokens
    after = scrape(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert received == 3 + 4 + 5 + 6
    assert delta("stepscope:generation_tokens_total{}") == received
    assert delta("stepscope:prompt_tokens_total{}") == prompt_tokens
    assert delta("stepscope:prefix_cache_queries_total{}") == prompt_tokens
    assert delta("stepscope:request_success_total{finished_reason=length}") == 4
    assert delta("stepscope:time_to_first_token_seconds_count{}") == 4
    assert delta("stepscope:e2e_request_latency_seconds_count{}") == 4
    assert delta("stepscope:request_queue_time_seconds_count{}") == 4
    assert delta("stepscope:inter_token_latency_seconds_count{}") == received - 4
    assert delta("stepscope:iteration_tokens_total_sum{}") >= received
    assert after["stepscope:num_requests_running{}"] == 0
    assert after["stepscope:num_requests_waiting{}"] == 0
    assert after["stepscope:num_preemptions_total{}"] == 0
    assert after["stepscope:kv_cache_usage_perc{}"] == 0
    assert "stepscope:decode_stall_seconds_count{}" in after
    # --metrics-compat vllm: the same figures under vLLM's names, labels and buckets
    for name in ("generation_tokens_total{}", "prompt_tokens_total{}",
                 "request_success_total{finished_reason=length}",
                 "time_to_first_token_seconds_count{}", "request_prefill_time_seconds_count{}",
                 "request_decode_time_seconds_count{}", "request_prompt_tokens_count{}"):  # fmt: skip
        vllm = "vllm:" + name.replace("{", "{engine=0,", 1).replace(",}", "}")
        assert after[vllm] == after["stepscope:" + name], name
    assert delta("vllm:request_generation_tokens_sum{engine=0}") == received
    assert delta("http_requests_total{handler=/v1/completions,method=POST,status=2xx}") == 4
    assert delta("http_request_duration_seconds_count{handler=/v1/completions,method=POST}") == 4


# -- safety: token and origins --------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: Path) -> Iterator[ApiServer]:
    """A server with a token, one running request at most and one waiting."""
    srv = start(tiny_llama_dir, "--token", "s3cret", "--max-running-req", "1", "--max-waiting", "1")
    try:
        yield srv
    finally:
        stop(srv)


def test_a_full_waiting_queue_answers_429_and_frees_up(guarded: ApiServer) -> None:
    body = {"prompt": words(6), "max_tokens": 900, "ignore_eos": True, "stream": True}
    running = open_stream(guarded, body, auth="s3cret")
    read_events(running, 1)  # admitted: it holds the one running slot
    waiting = open_stream(guarded, {**body, "prompt": words(7)}, auth="s3cret")
    client = openai.OpenAI(base_url=guarded.http_url + "/v1", api_key="s3cret", max_retries=0)
    ws = {"additional_headers": {"Authorization": "Bearer s3cret"}}
    c = guarded.client(**ws)
    deadline = time.monotonic() + 60
    while scrape(guarded, auth="s3cret")["stepscope:num_requests_waiting{}"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as full:
        client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
    assert full.value.status_code == 429 and full.value.body["code"] == "capacity"  # type: ignore[index]
    running.close()
    waiting.close()
    for _ in range(2):
        c.until(lambda m: m.get("event") == "aborted")
    c.close()
    assert_idle(guarded, **ws)
    out = client.completions.create(
        model=client.models.list().data[0].id, prompt="hi", max_tokens=2
    )
    assert out.usage.completion_tokens <= 2


def test_a_token_is_required_when_set_and_browsers_need_a_local_origin(
    guarded: ApiServer,
) -> None:
    srv = guarded
    status, reply = raw(srv, "GET", "/v1/models")
    assert status == 401 and isinstance(reply, dict)
    assert reply["error"]["type"] == "authentication_error"
    status, _ = raw(srv, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, _ = raw(srv, "GET", "/health")
    assert status == 200
    good = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="s3cret", max_retries=0)
    out = good.completions.create(model=good.models.list().data[0].id, prompt="hi",
                                  max_tokens=2)  # fmt: skip
    assert out.usage.completion_tokens <= 2
    auth = {"Authorization": "Bearer s3cret"}
    status, _ = raw(srv, "GET", "/metrics", headers={**auth, "Origin": "https://evil.test"})
    assert status == 403
    status, _ = raw(srv, "GET", "/metrics", headers={**auth, "Origin": "http://localhost:8501"})
    assert status == 200
    # a token on /v1 only: /metrics is scraped without it, as vLLM's --api-key guards only /v1
    samples = scrape(srv)
    assert samples["stepscope:num_requests_running{}"] == 0
    assert not any(name.startswith("vllm:") for name in samples)  # no compat switch here


def test_token_is_required_when_given(guarded: ApiServer) -> None:
    """The WebSocket protocol asks for the same token, and refuses cross-site origins."""
    with pytest.raises(InvalidStatus) as info:
        guarded.client()
    assert info.value.response.status_code == 401
    ok = guarded.client(additional_headers={"Authorization": "Bearer s3cret"})
    assert ok.stats()["integrity"] == "ok"
    with pytest.raises(InvalidStatus) as info:
        guarded.client(additional_headers={"Authorization": "Bearer s3cret"},
                       origin="https://evil.example")  # fmt: skip
    assert info.value.response.status_code == 403
    ok.close()


# -- parsing and stop strings on their own --------------------------------------------------


def test_parse_accepts_what_common_clients_send() -> None:
    req = parse_request(
        {"model": "m", "messages": [{"role": "developer", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_completion_tokens": 5, "max_tokens": 9, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True},
         "top_k": 0, "seed": 3, "stop": "x", "n": 1, "presence_penalty": 0, "user": "u",
         "logprobs": None, "ignore_eos": True, "temperature": 0},
        "chat",
    )  # fmt: skip
    assert req.messages == ({"role": "system", "content": "a\nb"},)
    assert (req.max_tokens, req.top_k, req.seed, req.stop) == (5, -1, 3, ("x",))
    assert req.stream and req.include_usage and req.continuous_usage and req.ignore_eos
    assert (
        parse_request({"prompt": ["only one"], "max_tokens": 16.0}, "completion").max_tokens == 16
    )
    assert parse_request({"prompt": [1, 2, 3]}, "completion").prompts == ([1, 2, 3],)
    assert parse_request({"prompt": "p"}, "completion").max_tokens is None  # the endpoint's
    batch = parse_request(
        b'{"prompt": [[1, 2], [3]], "n": 2, "seed": -9223372036854775808, "logprobs": 2, '
        b'"echo": true, "min_p": 0.1, "include_stop_str_in_output": true}',
        "completion",
    )
    assert (batch.prompts, batch.n, batch.choices, batch.logprobs) == (([1, 2], [3]), 2, 4, 2)
    assert batch.echo and batch.include_stop_str and batch.min_p == 0.1
    chat = parse_request(
        {"messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 3,
         "chat_template_kwargs": {"enable_thinking": False}, "skip_special_tokens": False,
         "stream": True, "stream_options": {}},
        "chat",
    )  # fmt: skip
    assert chat.logprobs == 3 and chat.chat_template_kwargs == {"enable_thinking": False}
    assert not chat.skip_special_tokens
    assert chat.include_usage  # stream_options without include_usage: on, as vLLM's default
    assert parse_request({"messages": [{"role": "user", "content": "q"}], "logprobs": True},
                         "chat").logprobs == 0  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "p", "max_tokens": 0},
        {"prompt": "p", "max_tokens": 1.5},
        {"prompt": "p", "temperature": "hot"},
        {"prompt": "p", "top_p": 0},
        {"prompt": "p", "top_k": -2},
        {"prompt": "p", "n": 0},
        {"prompt": "p", "best_of": 2},
        {"prompt": "p", "seed": 2**64},
        {"prompt": "p", "seed": True},
        {"prompt": "p", "min_p": 1.5},
        {"prompt": "p", "logprobs": -1},
        {"prompt": "p", "stop": [1]},
        {"prompt": "p", "stop": ["s"] * 17},
        {"prompt": "p", "stream": "yes"},
        {"prompt": ["a", ""]},
        {"prompt": [[]]},
        {"prompt": [True]},
        {"prompt": ""},
        {"prompt": "p", "model": 3},
        {"prompt": "p", "frequency_penalty": 1},
        {"prompt": "p", "prompt_logprobs": 0},
        {"prompt": "p", "add_special_tokens": False},
        {"prompt": "p", "bad_words": ["x"]},
        {"prompt": "p", "truncate_prompt_tokens": 4},
    ],
)
def test_parse_refuses_bad_fields(body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as exc:
        parse_request(body, "completion")
    assert exc.value.status == 400 and exc.value.body()["error"]["message"]


def test_stop_matcher_holds_back_what_may_start_a_stop_string() -> None:
    m = StopMatcher(("END",))
    shown = [m.push(p) for p in ["Hello ", "E", "N", "o", "ugh E", "ND and more"]]
    assert "".join(shown) == "Hello ENough " and m.stopped
    assert m.flush() == ""
    m = StopMatcher(("zz",))
    assert "".join(m.push(p) for p in ["ab", "cz"]) + m.flush() == "abcz" and not m.stopped
    m = StopMatcher(())
    assert [m.push("a"), m.push("b")] == ["a", "b"]
    m = StopMatcher(("ND", "END"), include_stop=True)  # the earliest start wins, kept in the text
    assert "".join(m.push(p) for p in ["xE", "ND", "more"]) + m.flush() == "xEND" and m.stopped


def test_metrics_has_its_own_token_and_is_open_without_one() -> None:
    from starlette.responses import PlainTextResponse
    from starlette.testclient import TestClient

    from engine.server.openai.api import HttpConfig
    from engine.server.openai.app import _Guard

    ok = PlainTextResponse("ok")

    def status(config: HttpConfig, path: str, token: str | None = None) -> int:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return TestClient(_Guard(ok, config)).get(path, headers=headers).status_code

    v1_only = HttpConfig(token="api")  # as vLLM's --api-key: /v1 only
    assert status(v1_only, "/metrics") == 200
    assert status(v1_only, "/v1/models") == 401 and status(v1_only, "/v1/models", "api") == 200
    both = HttpConfig(token="api", metrics_token="scrape")
    assert status(both, "/metrics") == 401 and status(both, "/metrics", "api") == 401
    assert status(both, "/metrics", "scrape") == 200
    assert status(both, "/v1/models", "scrape") == 401
