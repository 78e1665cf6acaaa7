"""The page's side of external engines, request sources and TP ranks, without a browser: figures on aggregate steps converted from real log fixtures,
the page's mode from hello.engine, the OpenAI submit against a local HTTP server, and each
rank's step time on synthetic messages."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import pytest

from app import aggregate, external, ranks
from app.derive import headline
from app.panels import _last_step_note, request_source
from app.sidebar import engine_line

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "watch"
Message = dict[str, Any]


def converted(tmp_path: Path, source: str, fixture: str) -> tuple[Message, list[Message]]:
    """The watch's own conversion of a fixture log: its hello and its steps."""
    out = tmp_path / "trace.jsonl"
    subprocess.run(
        [sys.executable, "-m", "instrumentation.watch", source, str(FIXTURES / fixture)]
        + ["--trace", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    messages = [json.loads(line) for line in out.read_text().splitlines()]
    hello = next(m for m in messages if m["type"] == "hello")
    return hello, [m for m in messages if m["type"] == "step"]


def trace(fig: go.Figure, name: str) -> Any:
    return next(t for t in fig.data if t.name == name)


def validated(fig: go.Figure) -> go.Figure:
    return go.Figure(fig.to_dict())  # plotly's validation, which the page turns off


@pytest.fixture(scope="module")
def chunked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Message, list[Message]]:
    return converted(
        tmp_path_factory.mktemp("w"), "sglang-log", "sglang_2024-10_tqdm_interleaved.log"
    )


def test_figures_draw_aggregate_steps_instead_of_raising(
    chunked: tuple[Message, list[Message]],
) -> None:
    _, steps = chunked
    assert steps and all(aggregate.is_aggregate(s) for s in steps)
    fig = validated(aggregate.aggregate_figure(steps))
    # The bars are the logged #new-token counts; cache hits are marks beside them, not work.
    assert list(trace(fig, "prompt tokens computed").y) == [s.get("prompt_tokens") for s in steps]
    cached = trace(fig, "prompt tokens served from cache (not computed)").y
    assert list(cached) == [s.get("cached_tokens") for s in steps]
    assert any(cached)
    # KV usage in percent, only where the source gave it; queue as logged.
    usage = trace(fig, "KV usage %").y
    assert [u is None for u in usage] == [s.get("kv", {}).get("usage") is None for s in steps]
    assert trace(fig, "waiting").y[-1] == steps[-1]["queue"]["waiting"]
    # No made-up pool fields: no used/cached/free/reserved page traces.
    names = {t.name for t in fig.data}
    assert not names & {"used pages", "cached pages", "free pages"}
    assert not any(n and n.startswith("reserved") for n in names)


def test_decode_lines_are_drawn_as_samples_of_n_steps(tmp_path: Path) -> None:
    _, steps = converted(tmp_path, "sglang-log", "sglang_2026-08_swa_chunked_long_prompt.log")
    sampled = [s for s in steps if (s.get("sample_of_steps") or 0) > 1]
    assert sampled
    fig = aggregate.aggregate_figure(steps)
    marks = trace(fig, "sample of N steps (one log line)")
    assert len(marks.x) == len(sampled)
    n = sampled[0]["sample_of_steps"]
    assert f"sample of {n} steps" in marks.hovertext[0]
    # SGLang's decode lines count requests, not tokens: the bar says requests.
    row = aggregate.aggregate_step(sampled[0])
    assert row.decode_bar == (sampled[0]["decode_requests"], "decode requests")
    tps = trace(fig, "gen tokens/s (logged)").y
    assert [tps[i] for i, s in enumerate(steps) if s in sampled] == [
        s.get("gen_throughput") for s in sampled
    ]
    assert _last_step_note(sampled[-1]).endswith(f"sample of {n} steps")


def test_vllm_iteration_steps_draw_decode_tokens(tmp_path: Path) -> None:
    _, steps = converted(tmp_path, "vllm-log", "vllm_2025-12_iteration_details.log")
    fig = validated(aggregate.aggregate_figure(steps))
    assert list(trace(fig, "decode").y) == [s["decode_tokens"] for s in steps]
    assert headline(steps, []).running == 0  # nothing invented for requests the log does not name


def test_metric_row_reads_the_logged_rates_and_invents_no_stalls(tmp_path: Path) -> None:
    _, steps = converted(tmp_path, "sglang-log", "sglang_2026-08_swa_chunked_long_prompt.log")
    h = aggregate.headline(steps, headline(steps, []))
    logged = [s["gen_throughput"] for s in steps if "gen_throughput" in s]
    assert h.tokens_per_s == logged[-1]
    assert h.kv_used == [s["kv"]["usage"] for s in steps if "usage" in s.get("kv", {})][-1]
    assert h.worst_stall is None and h.kv_cached is None


def test_aggregate_step_leaves_unknowns_empty() -> None:
    row = aggregate.aggregate_step(
        {"step": 3, "t0": 0.0, "t1": 1.0, "phase": "decode", "items": [], "source": "x"}
    )
    assert row.prompt_tokens is None and row.kv_usage is None and row.budget is None
    assert row.hover() == "step 3 · decode"
    used = aggregate.aggregate_step(
        {"step": 0, "t1": 0.0, "items": [], "kv": {"unit": "block", "used": 30, "total": 120}}
    )
    assert used.kv_usage == pytest.approx(0.25)


def test_page_mode_from_hello(chunked: tuple[Message, list[Message]]) -> None:
    hello, _ = chunked
    mode = external.external_mode(hello["engine"])
    assert mode.external and not mode.can_submit and not mode.commands
    assert hello["engine"]["commands_reason"] in mode.disabled_note()
    assert "sglang-log" in mode.disabled_note()
    assert external.external_mode({"model": "m"}) == external.ExternalMode(False)
    with_url = external.external_mode({**hello["engine"], "openai_url": "http://h:1/"})
    assert with_url.can_submit and with_url.openai_url == "http://h:1"
    # The app's own URL wins over the watch's.
    assert external.external_mode(hello["engine"], "http://mine:2").openai_url == "http://mine:2"
    assert "external engine" in engine_line(hello["engine"])


def test_openai_url_from_argv_then_env() -> None:
    env = {"STEPSCOPE_OPENAI_URL": "http://env:9/"}
    assert external.openai_url_from(["--openai-url", "http://a:1/"], env) == "http://a:1"
    assert external.openai_url_from(["--openai-url=http://b:2"], {}) == "http://b:2"
    assert external.openai_url_from([], env) == "http://env:9"
    assert external.openai_url_from([], {}) is None


class _Completions(BaseHTTPRequestHandler):
    seen: list[tuple[str, Message]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, body))
        if self.path.endswith("/chat/completions"):
            reply = {"choices": [{"message": {"role": "assistant", "content": "hi chat"}}]}
        else:
            reply = {"choices": [{"text": "hi text"}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_openai_submit_posts_completions_and_chat() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        plain = external.OpenAISubmit(
            external.openai_request(url, "Hello", 8, 0.0, False, "m")
        ).start()
        chat = external.OpenAISubmit(external.openai_request(url, "Hi", 4, 0.5, True, None)).start()
        assert plain.wait(30) and chat.wait(30)
        assert (plain.text, plain.error) == ("hi text", None)
        assert (chat.text, chat.error) == ("hi chat", None)
        paths = dict(_Completions.seen)
        assert paths["/v1/completions"] == {
            "max_tokens": 8, "temperature": 0.0, "model": "m", "prompt": "Hello"
        }  # fmt: skip
        assert paths["/v1/chat/completions"]["messages"] == [{"role": "user", "content": "Hi"}]
    finally:
        server.shutdown()
        server.server_close()
    failed = external.OpenAISubmit(external.openai_request(url, "x", 1, 0.0, False, None)).start()
    assert failed.wait(30) and failed.error is not None  # the server is gone: said, not raised


def test_request_source_column_values() -> None:
    assert request_source({"uid": 1, "source": "http"}) == "http"
    assert request_source({"uid": 2, "source": None}) == "ws/page"
    assert request_source({"uid": 3}) == "ws/page"


def _tp_step(n: int, times: list[float | None], comm: float = 0.001) -> Message:
    return {
        "step": n,
        "t0": float(n),
        "t1": n + 0.5,
        "phase": "decode",
        "items": [],
        "ranks": [{"rank": r, "forward_s": t, "comm_s": comm} for r, t in enumerate(times)],
    }


def test_rank_times_show_a_straggler() -> None:
    steps = [_tp_step(n, [0.010, 0.030 if n % 2 else 0.011]) for n in range(6)]
    steps.insert(2, {"step": 99, "t0": 0.0, "t1": 0.0, "phase": "decode", "items": []})
    steps.append(_tp_step(7, [0.010, None]))
    numbers, series = ranks.rank_series(steps)
    assert numbers == [0, 1, 2, 3, 4, 5, 7]  # steps without ranks are not on this axis
    assert series[0].forward_ms[:2] == pytest.approx([10.0, 10.0])
    assert series[1].forward_ms[1] == pytest.approx(30.0)
    assert series[1].forward_ms[-1] is None  # not measured: a gap, not a zero
    assert ranks.slowest_rank(series) == 1
    fig = validated(ranks.ranks_figure(steps))
    assert {t.name for t in fig.data} == {
        "rank 0 forward", "rank 1 forward", "rank 0 all-reduce", "rank 1 all-reduce"
    }  # fmt: skip
    assert ranks.slowest_rank({}) is None


def test_engine_line_names_the_tp_degree() -> None:
    engine = {"model": "m", "device": "cuda", "dtype": "bfloat16", "num_pages": 10}
    assert "TP" not in engine_line(engine)
    assert "TP 2" in engine_line({**engine, "tp_size": 2})
    assert ranks.tp_caption({"tp_size": 4}) == "tensor parallel over 4 ranks"
    assert ranks.tp_caption({"tp_size": 1}) is None


def test_requests_table_has_a_source_column(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request sent from the page (over the WebSocket) shows as `ws/page` in the table."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from tests.app.app_peer import AppPeer
    from tests.app.test_app_ui import APP, connected, settle

    with AppPeer(tick_s=0.01) as peer:
        monkeypatch.setenv("STEPSCOPE_URL", peer.url)
        monkeypatch.setenv("STEPSCOPE_AUTOSTART", "0")
        at = AppTest.from_file(APP, default_timeout=30)
        try:
            assert settle(at, lambda: connected(at))
            at.text_area(key="prompt_text").input("hello there")
            at.button(key="FormSubmitter:prompt-Submit").click().run()
            at.session_state["detail_tab"] = "Requests"
            assert settle(at, lambda: len(at.dataframe) > 0)
            table = at.dataframe[0].value
            assert list(table.columns[:3]) == ["uid", "source", "state"]
            assert set(table["source"]) == {"ws/page"}
        finally:
            st.cache_resource.clear()


def _watch(*args: str) -> tuple[subprocess.Popen, str]:
    """`python -m instrumentation.watch ... --port 0` and the URL from its stderr line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "instrumentation.watch", *args, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "watch: serving ws://" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, line[line.index("ws://") :].strip()
    proc.wait(10)
    raise AssertionError("the watch exited before serving")


@pytest.mark.parametrize("with_url", [False, True])
def test_page_on_a_watch_disables_commands_or_posts_to_openai(
    monkeypatch: pytest.MonkeyPatch, with_url: bool
) -> None:
    """Watching a log: no submit form (the reason is shown) unless an OpenAI URL is given,
    and then a submit is a POST to its /v1/chat/completions, not a protocol command."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from tests.app.test_app_ui import APP, connected, settle, texts

    _Completions.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc, url = _watch("sglang-log", str(FIXTURES / "sglang_2024-11_chunked_2048.log"))
    try:
        monkeypatch.setenv("STEPSCOPE_URL", url)
        monkeypatch.setenv("STEPSCOPE_AUTOSTART", "0")
        openai = f"http://127.0.0.1:{server.server_address[1]}"
        if with_url:
            monkeypatch.setenv("STEPSCOPE_OPENAI_URL", openai)
        at = AppTest.from_file(APP, default_timeout=30)
        assert settle(at, lambda: connected(at) and at.session_state["page_mode"].external)
        at.run()
        reason = "cannot submit, abort or change its configuration"
        sidebar = " ".join(texts(at.sidebar.caption))
        assert "Budget and policy: Unavailable (watching sglang-log): this is a watch" in sidebar
        assert reason in sidebar
        assert all(b.disabled for b in at.sidebar.button if (b.key or "").startswith("preset-"))
        assert not [s for s in at.sidebar.select_slider if s.key == "budget_slider"]
        forms = [t for t in at.text_area if t.key == "prompt_text"]
        if not with_url:
            assert not forms
            assert any(reason in t and "Submitting prompts" in t for t in texts(at.info))
            return
        assert forms and any(openai in t for t in texts(at.caption))
        at.text_area(key="prompt_text").input("hello over http")
        at.button(key="FormSubmitter:prompt-Submit").click().run()
        assert settle(at, lambda: bool(_Completions.seen))
        path, body = _Completions.seen[0]
        assert path == "/v1/chat/completions"
        assert body["messages"] == [{"role": "user", "content": "hello over http"}]
        assert settle(at, lambda: any("hi chat" in t for t in texts(at.caption)))
    finally:
        st.cache_resource.clear()
        proc.terminate()
        proc.wait(15)
        server.shutdown()
        server.server_close()


def test_ranks_view_draws_when_steps_carry_ranks() -> None:
    from streamlit.testing.v1 import AppTest

    def page() -> None:
        from app import panels

        steps = [
            {
                "step": n,
                "t0": float(n),
                "t1": n + 0.5,
                "phase": "decode",
                "items": [],
                "ranks": [
                    {"rank": 0, "forward_s": 0.01, "comm_s": 0.001},
                    {"rank": 1, "forward_s": 0.03, "comm_s": 0.002},
                ],
            }
            for n in range(4)
        ]
        panels.ranks_view(steps, {"tp_size": 2})
        panels.ranks_view([{**s, "ranks": None} for s in steps], {"tp_size": 1})  # draws nothing

    at = AppTest.from_function(page, default_timeout=30).run()
    assert not at.exception
    assert [m.value for m in at.markdown] == [
        "**Ranks** (tensor parallel over 2 ranks · slowest on average: rank 1)"
    ]
    assert len(at.get("plotly_chart")) == 1


def test_external_charts_draw_the_prefix_cache_from_kv_events() -> None:
    """A watch that relays KV events: the page draws the cache's blocks under the aggregate
    figure, each batch at the step it followed; without KV events that figure is absent."""
    from streamlit.testing.v1 import AppTest

    def page() -> None:
        from app import panels
        from app.state import Snapshot

        steps = [
            {"step": n, "t0": float(n), "t1": n + 0.5, "phase": "decode", "items": [],
             "source": "vllm-fpm", "decode_requests": 4}
            for n in range(4)
        ]  # fmt: skip
        kv = [
            {"type": "kv_events", "kv_seq": i, "t": 0.7 + i, "blocks": b, "tokens": 16 * b,
             "stored_blocks": b, "removed_blocks": 0, "cleared": False, "block_size": 16}
            for i, b in enumerate((2, 5))
        ]  # fmt: skip
        import streamlit as st

        kv = kv if st.session_state.get("with_kv", True) else []
        panels.external_charts(Snapshot(steps, [], {"external": True}, None, 1, kv_events=kv))

    at = AppTest.from_function(page, default_timeout=30)
    at.session_state["with_kv"] = False
    at.run()
    # the engine's lane of steps and the aggregate figure
    assert not at.exception and not at.markdown and len(at.get("plotly_chart")) == 2
    at = AppTest.from_function(page, default_timeout=30).run()
    assert not at.exception
    assert [m.value for m in at.markdown] == ["**Prefix cache (KV events)**"]
    charts = at.get("plotly_chart")
    assert len(charts) == 3  # no reuse reported: no hit-rate figure
    fig = json.loads(charts[2].proto.spec)
    held = next(t for t in fig["data"] if t["name"] == "blocks held")
    assert held["x"] == [0, 1] and held["y"] == [2, 5]  # received after steps 0 and 1 ended


def test_store_keeps_kv_events_across_a_resync_and_forgets_them_on_restart() -> None:
    from app.state import EventStore

    def kv(i: int) -> dict:
        return {"type": "kv_events", "kv_seq": i, "t": float(i), "blocks": i}

    def hello(instance: str, history: list[dict]) -> dict:
        engine = {"external": True, "instance": instance}
        return {"type": "hello", "seq": 0, "now": 0.0, "engine": engine,
                "history": {"steps": [], "requests": [], "kv_events": history}}  # fmt: skip

    store = EventStore()
    store.apply(hello("a", [kv(0), kv(1)]))
    store.apply(kv(2))
    assert [m["kv_seq"] for m in store.snapshot().kv_events] == [0, 1, 2]
    store.apply(hello("a", [kv(2), kv(3)]))  # a resync whose history starts later: ours kept
    assert [m["kv_seq"] for m in store.snapshot().kv_events] == [0, 1, 2, 3]
    store.apply(hello("b", [kv(0)]))  # another watch: its batches only
    assert [m["blocks"] for m in store.snapshot().kv_events] == [0]
    store.clear()
    assert store.snapshot().kv_events == []
