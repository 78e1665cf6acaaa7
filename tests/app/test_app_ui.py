"""The page, run by Streamlit's AppTest against the in-test protocol peer (tests/app/app_peer.py).

Every control must leave the page as the right protocol command: these tests read what the
peer received, not what the script meant to send.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from app import workloads
from tests.app.app_peer import AppPeer

APP = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def settle(at: AppTest, predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Rerun the page until `predicate` holds; the timeout only bounds a failing test."""
    deadline = time.monotonic() + timeout
    while True:
        at.run()
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def texts(elements: object) -> list[str]:
    return [str(e.value) for e in elements]  # type: ignore[attr-defined]


def connected(at: AppTest) -> bool:
    return any("connected" in t and "not" not in t for t in texts(at.sidebar.markdown))


@pytest.fixture
def peer() -> Iterator[AppPeer]:
    with AppPeer(tick_s=0.01) as p:
        yield p


def _app(monkeypatch: pytest.MonkeyPatch, url: str, autostart: bool = False) -> AppTest:
    monkeypatch.setenv("STEPSCOPE_URL", url)
    monkeypatch.setenv("STEPSCOPE_AUTOSTART", "1" if autostart else "0")
    return AppTest.from_file(APP, default_timeout=30)


@pytest.fixture
def app(peer: AppPeer, monkeypatch: pytest.MonkeyPatch) -> Iterator[AppTest]:
    at = _app(monkeypatch, peer.url)

    def ready() -> bool:
        # connected, and the engine's config arrived: the scheduling controls appear only then
        # (a loaded machine can draw the page between the two)
        return connected(at) and any(w.key == "budget_exact" for w in at.text_input)

    assert settle(at, ready), texts(at.sidebar.markdown)
    yield at
    st.cache_resource.clear()  # closes the engine link (and stops any launched engine)


@pytest.fixture(autouse=True)
def _release_resources() -> Iterator[None]:
    yield
    st.cache_resource.clear()


# ---- controls → protocol commands -------------------------------------------------------------


def test_budget_slider_sends_set_config_and_shows_the_reply(app: AppTest, peer: AppPeer) -> None:
    app.select_slider(key="budget_slider").set_value(128).run()
    sent = peer.received("set_config")
    assert [c.get("max_extend_tokens") for c in sent] == [128]
    assert isinstance(sent[0]["id"], str) and "policy" not in sent[0]
    assert any("max_extend_tokens=128" in t for t in texts(app.success))
    assert app.text_input(key="budget_exact").value == "128"


def test_exact_budget_sends_any_value_and_moves_the_slider(app: AppTest, peer: AppPeer) -> None:
    app.text_input(key="budget_exact").set_value("100").run()
    assert peer.received("set_config")[-1]["max_extend_tokens"] == 100
    assert app.select_slider(key="budget_slider").value == 100
    app.text_input(key="budget_exact").set_value("1").run()
    assert peer.received("set_config")[-1]["max_extend_tokens"] == 1


@pytest.mark.parametrize("typed", ["", "abc", "0", "-5", "2.5"])
def test_exact_budget_refuses_what_is_not_a_budget(app: AppTest, peer: AppPeer, typed: str) -> None:
    """An emptied box or letters are refused with a message, never read as 1; the box shows
    the budget in force again."""
    app.text_input(key="budget_exact").set_value("64").run()
    sent = len(peer.received("set_config"))
    app.text_input(key="budget_exact").set_value(typed).run()
    assert len(peer.received("set_config")) == sent  # nothing went out
    assert peer.sim.config["max_extend_tokens"] == 64
    assert any("max_extend_tokens must be" in t for t in texts(app.error))
    assert app.text_input(key="budget_exact").value == "64"
    # the slider left at another value (a browser's stale one): the box still shows the engine's
    app.session_state["budget_slider"] = 1
    app.text_input(key="budget_exact").set_value(f"{typed} ").run()
    assert peer.sim.config["max_extend_tokens"] == 64
    assert app.text_input(key="budget_exact").value == "64"
    assert app.select_slider(key="budget_slider").value == 64


def test_the_other_budget_control_coming_back_does_not_undo_a_change(
    app: AppTest, peer: AppPeer
) -> None:
    """The exact box sets 48: the slider, drawn before, still shows the old budget in the
    browser, and a rerun started then sends it back. It is not taken for a choice (seen: the
    engine back at 8 a moment after the box set 48); nor is the box's old text after the slider
    moved."""
    app.text_input(key="budget_exact").set_value("8").run()
    assert peer.sim.config["max_extend_tokens"] == 8
    app.text_input(key="budget_exact").set_value("48").run()
    app.select_slider(key="budget_slider").set_value(8).run()
    assert [c["max_extend_tokens"] for c in peer.received("set_config")] == [8, 48]
    assert peer.sim.config["max_extend_tokens"] == 48
    assert app.text_input(key="budget_exact").value == "48"
    assert app.select_slider(key="budget_slider").value == 48
    app.select_slider(key="budget_slider").set_value(64).run()
    app.text_input(key="budget_exact").set_value("48").run()
    assert [c["max_extend_tokens"] for c in peer.received("set_config")] == [8, 48, 64]
    assert app.text_input(key="budget_exact").value == "64"


def test_policy_switch_sends_set_config(app: AppTest, peer: AppPeer) -> None:
    app.radio(key="policy").set_value("mixed").run()
    assert peer.received("set_config")[-1] == {
        "type": "set_config",
        "id": peer.received("set_config")[-1]["id"],
        "policy": "mixed",
    }
    assert peer.sim.config["policy"] == "mixed"


def test_controls_follow_a_config_changed_elsewhere(app: AppTest, peer: AppPeer) -> None:
    with peer._lock:
        peer._command({"type": "set_config", "id": "other-tab", "max_extend_tokens": 32})
    assert settle(app, lambda: app.text_input(key="budget_exact").value == "32")
    assert app.select_slider(key="budget_slider").value == 32


def test_a_store_behind_this_tabs_own_change_does_not_undo_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine ran a budget of 8 (set by another tab); this tab sets 48, and the engine's
    reply comes before the store folds the broadcast: the store still says 8 for a moment. The
    controls keep 48 (they went back to 8), and follow a change made elsewhere once STALE_S has
    passed. Session state in Streamlit's bare mode: the functions, without a page."""
    from app import rerun, session

    def config(budget: int) -> dict:
        return {"max_extend_tokens": budget, "policy": "prefill_first", "admission": "reserve"}

    for key in list(st.session_state):
        del st.session_state[key]
    now = [1000.0]
    monkeypatch.setattr(rerun.time, "monotonic", lambda: now[0])
    rerun.sync_controls(config(8))
    assert session.BUDGET_EXACT.get() == "8"
    rerun.remember_own(config(48))  # this tab's set_config, confirmed by the engine's reply
    rerun.show("max_extend_tokens", 48)
    now[0] += 0.5
    rerun.sync_controls(config(8))  # the store, a moment behind
    assert session.BUDGET_EXACT.get() == "48" and session.BUDGET_SLIDER.get() == 48
    now[0] += rerun.STALE_S
    rerun.sync_controls(config(16))  # another tab's change, later
    assert session.BUDGET_EXACT.get() == "16" and session.BUDGET_SLIDER.get() == 16


def test_a_stale_value_coming_back_from_the_browser_does_not_undo_a_sync(
    app: AppTest, peer: AppPeer
) -> None:
    before = app.text_input(key="budget_exact").value
    with peer._lock:
        peer._command({"type": "set_config", "id": "preset", "max_extend_tokens": 16})
    assert settle(app, lambda: app.text_input(key="budget_exact").value == "16")
    # a rerun the browser started before the sync reached it still carries the old value
    app.text_input(key="budget_exact").set_value(before).run()
    assert peer.received("set_config") == [] or all(
        c.get("id") == "preset" for c in peer.received("set_config")
    )
    assert app.text_input(key="budget_exact").value == "16"
    assert peer.sim.config["max_extend_tokens"] == 16


def test_prompt_form_submits_copies_with_every_field(app: AppTest, peer: AppPeer) -> None:
    app.text_area(key="prompt_text").input("Why is the sea salty?")
    app.number_input(key="max_tokens").set_value(7)
    app.number_input(key="temperature").set_value(0.5)
    app.number_input(key="copies").set_value(3)
    app.toggle(key="chat").set_value(False)
    app.toggle(key="ignore_eos").set_value(True)
    app.button(key="FormSubmitter:prompt-Submit").click().run()
    sent = peer.received("submit")
    assert len(sent) == 3 and len({c["id"] for c in sent}) == 3
    for cmd in sent:
        assert {
            k: cmd[k] for k in ("prompt", "max_tokens", "temperature", "chat", "ignore_eos")
        } == {
            "prompt": "Why is the sea salty?",
            "max_tokens": 7,
            "temperature": 0.5,
            "chat": False,
            "ignore_eos": True,
        }
    assert "submitted: request 0, 1, 2" in texts(app.success)


def test_the_form_declares_the_defaults_a_browser_falls_back_to(app: AppTest) -> None:
    """A browser that loses a number box's state (a remount) shows the default the widget
    declared in its message, not the value the server holds: undeclared, that is 0, and a
    Submit nobody touched was refused with "copies must be between 1 and 64"."""
    app.run()  # a later run: the boxes' values now come from the browser, not from the server
    boxes = {k: app.number_input(key=k).proto for k in ("max_tokens", "temperature", "copies")}
    assert {k: p.default for k, p in boxes.items()} == {
        "max_tokens": 64,
        "temperature": 0.0,
        "copies": 1,
    }
    assert not any(p.set_value for p in boxes.values())


def test_empty_prompt_is_refused_in_the_page(app: AppTest, peer: AppPeer) -> None:
    app.button(key="FormSubmitter:prompt-Submit").click().run()
    assert peer.received("submit") == []
    assert any("prompt is empty" in t for t in texts(app.error))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be"),
        ("temperature", -1.0, "temperature must be"),
        ("copies", 65, "copies must be between"),
    ],
)
def test_an_invalid_form_field_is_refused_with_a_message(
    app: AppTest, peer: AppPeer, field: str, value: float, message: str
) -> None:
    """A bad value reaches the page's own check (no browser-side limit silently blocks
    Submit), and the refusal replaces the last notice instead of leaving it on screen."""
    app.text_area(key="prompt_text").input("Hi")
    app.button(key="FormSubmitter:prompt-Submit").click().run()
    assert "submitted: request 0" in texts(app.success)
    app.number_input(key=field).set_value(value)
    app.button(key="FormSubmitter:prompt-Submit").click().run()
    assert len(peer.received("submit")) == 1
    assert any(message in t for t in texts(app.error)), texts(app.error)
    assert not texts(app.success)


def test_engine_error_replies_are_shown(app: AppTest, peer: AppPeer) -> None:
    app.text_area(key="prompt_text").input("x" * 100)
    app.number_input(key="max_tokens").set_value(5000)  # beyond the peer's max_seq_len
    app.button(key="FormSubmitter:prompt-Submit").click().run()
    assert len(peer.received("submit")) == 1
    assert any("too_large" in t for t in texts(app.error))


def test_abort_button_aborts_that_request_and_says_so(app: AppTest, peer: AppPeer) -> None:
    app.text_area(key="prompt_text").input("a long story please")
    app.number_input(key="max_tokens").set_value(4000)
    app.button(key="FormSubmitter:prompt-Submit").click().run()
    app.session_state["detail_tab"] = "Requests"
    assert settle(app, lambda: any(b.key == "abort-0" for b in app.button))
    app.button(key="abort-0").click().run()
    assert [c["uid"] for c in peer.received("abort")] == [0]
    assert settle(app, lambda: peer.sim.requests[0].state == "aborted")
    assert any("request 0 aborted" in t for t in texts(app.success))
    assert not texts(app.error)  # v1.1 acknowledges an abort: no "No reply" error


# ---- presets ----------------------------------------------------------------------------------


def test_chapter_preset_sets_the_budget_then_sends_the_three_prompts(
    app: AppTest, peer: AppPeer
) -> None:
    app.button(key="preset-chapter").click().run()
    assert peer.wait_for(lambda: len(peer.received("submit")) == 3)
    cfg = peer.received("set_config")
    assert [(c["max_extend_tokens"], c["policy"]) for c in cfg] == [(16, "prefill_first")]
    sent = peer.received("submit")
    assert [c["prompt"] for c in sent] == list(workloads.CHAPTER_PROMPTS)
    assert all(c["max_tokens"] == 3 and c["ignore_eos"] is True for c in sent)
    assert peer.commands.index(cfg[0]) < peer.commands.index(sent[0])


def test_stall_preset_sends_the_long_prompt_after_the_chats_decode(
    app: AppTest, peer: AppPeer
) -> None:
    app.button(key="preset-stall").click().run()
    assert peer.wait_for(lambda: len(peer.received("submit")) == 5, timeout=30)
    sent = peer.received("submit")
    assert all(c["chat"] and c["max_tokens"] == 96 for c in sent[:4])
    assert sent[4]["prompt"].endswith(workloads.LONG_PROMPT)
    # The long prompt went out only once every chat had decoded a few tokens.
    at_long = peer.sim.requests[4].t_queued
    for uid in range(4):
        req = peer.sim.requests[uid]
        assert req.t_first_token is not None and req.t_first_token < at_long


def test_stall_preset_played_twice_is_not_served_by_the_prefix_cache(
    app: AppTest, peer: AppPeer
) -> None:
    for n in (1, 2):
        app.button(key="preset-stall").click().run()
        assert peer.wait_for(lambda n=n: len(peer.received("submit")) == 5 * n, timeout=30)
    chats = [c["prompt"] for c in peer.received("submit") if c["chat"]]
    long_prompts = [c["prompt"] for c in peer.received("submit") if not c["chat"]]
    assert chats[:4] == chats[4:]
    # The two long prompts part within their first few characters: no prefix-cache hit to speak of.
    assert len(os.path.commonprefix(long_prompts)) < 10


def test_shared_prefix_and_burst_presets(app: AppTest, peer: AppPeer) -> None:
    app.button(key="preset-shared").click().run()
    assert peer.wait_for(lambda: len(peer.received("submit")) == 5, timeout=30)
    prompts = [c["prompt"] for c in peer.received("submit")]
    assert all(p.startswith(workloads.SYSTEM_PROMPT) for p in prompts)
    assert len(set(prompts)) == 5
    app.button(key="preset-burst").click().run()
    assert peer.wait_for(lambda: len(peer.received("submit")) == 5 + 12)


# ---- views ------------------------------------------------------------------------------------


def charts(at: AppTest) -> dict:
    """The live charts' payload: what the browser would append (app/live)."""
    [el] = [e for e in at.get("bidi_component") if e.proto.component_name == "stepscope.live"]
    return json.loads(el.proto.json)


def fresh(at: AppTest) -> dict:
    """The payload a newly opened browser would get: everything in the window."""
    at.session_state["live_seen"] = {}
    at.run()
    return charts(at)


def test_live_charts_get_steps_and_pausing_stops_them(app: AppTest, peer: AppPeer) -> None:
    app.text_area(key="prompt_text").input("hello " * 40)
    app.button(key="FormSubmitter:prompt-Submit").click().run()
    assert settle(app, lambda: len(peer.steps) > 5 and len(fresh(app)["steps"]["step"]) > 5)
    data = fresh(app)
    assert data["reset"] and not data.get("paused") and not app.get("plotly_chart")
    assert {"timeline", "kv", "progress", "latency"} <= set(data["captions"])
    assert data["assets"]["plotly"].endswith("plotly.min.js")
    assert data["requests"][0][:2] == [0, "running"] or data["requests"][0][0] == 0
    app.toggle(key="live").set_value(False).run()
    assert charts(app)["paused"]
    assert any("Paused" in t for t in texts(app.info))
    app.toggle(key="live").set_value(True).run()
    assert not charts(app).get("paused")


def test_every_tab_draws(app: AppTest, peer: AppPeer) -> None:
    app.text_area(key="prompt_text").input("a long story please " * 5)
    app.number_input(key="max_tokens").set_value(400)
    app.button(key="FormSubmitter:prompt-Submit").click().run()
    assert peer.wait_for(lambda: len(peer.steps) >= 6)
    for tab in ("Output text", "KV page map", "Requests"):
        app.session_state["detail_tab"] = tab
        app.run()
        assert not app.exception, tab
        if tab == "KV page map":
            [el] = [
                e
                for e in app.get("bidi_component")
                if e.proto.component_name != "stepscope.live"
                or json.loads(e.proto.json).get("mode") == "kvmap"
            ]
            data = json.loads(el.proto.json)
            assert data["mode"] == "kvmap" and data["map"]["num_pages"] == 4096
            assert any(run[2] == 0 and run[1] == 2 for run in data["map"]["runs"])
            assert peer.received("kv_map")  # asked for only while this tab is open
        assert not app.get("plotly_chart")  # every chart is the component, drawn in the browser
    table = app.dataframe[0].value
    assert list(table["uid"]) == [0]
    assert {"state", "prompt", "cached", "TTFT (s)", "worst stall (s)", "text"} <= set(table)
    asked = len(peer.received("kv_map"))
    app.run()
    assert len(peer.received("kv_map")) == asked  # closed: the page map costs nothing


def test_clear_history_empties_the_charts(app: AppTest, peer: AppPeer) -> None:
    app.button(key="preset-chapter").click().run()
    assert peer.wait_for(lambda: all(r.state == "finished" for r in peer.sim.requests.values()))
    assert settle(app, lambda: len(fresh(app)["steps"]["step"]) > 0)
    # the peer is done, but its last messages may still be on their way to the page: clearing
    # before they land would let them draw again; wait until the charts stop changing
    last: list[object] = [None]

    def unchanged() -> bool:
        time.sleep(0.3)
        steps = fresh(app)["steps"]["step"]
        same, last[0] = steps == last[0], steps
        return same

    assert settle(app, unchanged)
    [clear] = [b for b in app.button if b.label == "Clear history"]
    clear.click().run()
    data = charts(app)
    assert data["reset"] and data["steps"]["step"] == []


def test_there_are_no_classic_charts(peer: AppPeer, monkeypatch: pytest.MonkeyPatch) -> None:
    """`?charts=classic` and STEPSCOPE_CHARTS are gone: the page draws the one chart component
    whatever they say, and no plotly figure built in Python."""
    monkeypatch.setenv("STEPSCOPE_CHARTS", "classic")
    at = _app(monkeypatch, peer.url)
    at.query_params["charts"] = "classic"
    assert settle(at, lambda: connected(at))
    at.button(key="preset-chapter").click().run()
    assert peer.wait_for(lambda: len(peer.steps) >= 6)
    assert settle(at, lambda: len(fresh(at)["steps"]["step"]) >= 6)
    assert not at.get("plotly_chart")


# ---- connection -------------------------------------------------------------------------------


def test_an_invalid_url_is_explained(app: AppTest) -> None:
    app.text_input(key="url").input("http://127.0.0.1:8765").run()
    assert any("must start with ws://" in t for t in texts(app.error))


def test_an_emptied_url_keeps_the_engine_every_tab_follows(app: AppTest, peer: AppPeer) -> None:
    app.text_input(key="url").input("").run()
    assert app.text_input(key="url").value == peer.url
    assert not any("must start with ws://" in t for t in texts(app.error))
    app.select_slider(key="budget_slider").set_value(128).run()  # still talking to the peer
    assert [c["max_extend_tokens"] for c in peer.received("set_config")] == [128]


def test_a_url_change_in_one_tab_moves_every_tab(app: AppTest, peer: AppPeer) -> None:
    other_tab = AppTest.from_file(APP, default_timeout=30)
    other_tab.run()
    with AppPeer() as second:
        app.text_input(key="url").input(second.url).run()
        assert settle(other_tab, lambda: connected(other_tab))
        assert other_tab.text_input(key="url").value == second.url
        other_tab.select_slider(key="budget_slider").set_value(2).run()
        assert [c["max_extend_tokens"] for c in second.received("set_config")] == [2]
    assert peer.received("set_config") == []


def test_nothing_answering_is_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    with AppPeer() as gone:
        url = gone.url
    at = _app(monkeypatch, url)
    assert settle(at, lambda: any("Nothing answers" in t for t in texts(at.warning)))
    assert not at.get("plotly_chart")


FAKE_ENGINE = (
    "import sys, time; print('stepscope: loading fake ...', flush=True); "
    "sys.stdout.write('loading weights:  40%|####      | 2/5\\n'); sys.stdout.flush(); "
    "time.sleep(float(sys.argv[1])); sys.exit(3)"
)


def test_the_page_starts_its_engine_on_a_free_http_port_unless_told() -> None:
    from app.launcher import engine_argv

    assert engine_argv(8765, "smollm2")[-2:] == ["--http-port", "0"]
    told = engine_argv(8765, "smollm2", ("--http-port", "8001"))
    assert told.count("--http-port") == 1 and told[-1] == "8001"
    assert engine_argv(8765, "smollm2", ("--http-port=none",)).count("--http-port") == 0


def test_a_port_the_user_asked_for_that_is_taken_is_said_plainly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = (
        "import sys; print('stepscope: cannot listen on 127.0.0.1:8000: [Errno 98] Address "
        "already in use', file=sys.stderr, flush=True); sys.exit(2)"
    )
    monkeypatch.setattr("app.launcher.engine_argv", lambda *a, **k: [sys.executable, "-c", taken])
    with AppPeer() as gone:
        url = gone.url
    at = _app(monkeypatch, url, autostart=True)
    assert settle(at, lambda: any("Port 8000 on 127.0.0.1 is taken" in t for t in texts(at.error)))
    [said] = [t for t in texts(at.error) if "is taken" in t]
    assert "--http-port 0" in said and "STEPSCOPE_URL" in said


def test_autostart_shows_loading_progress_then_a_dead_engine_and_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launched: list[list[str]] = []

    def fake_argv(port: int, model: str, extra: tuple[str, ...] = ()) -> list[str]:
        launched.append([str(port), model])
        return [sys.executable, "-c", FAKE_ENGINE, "1.5"]

    monkeypatch.setattr("app.launcher.engine_argv", fake_argv)
    with AppPeer() as gone:
        url, port = gone.url, gone.port
    at = _app(monkeypatch, url, autostart=True)
    assert settle(at, lambda: bool(at.get("progress")))
    assert launched == [[str(port), "smollm2"]]
    assert "loading weights" in at.get("progress")[0].proto.text
    assert not at.get("plotly_chart")  # progress instead of empty charts
    assert settle(at, lambda: any("exited with code 3" in t for t in texts(at.error)))
    at.button(key="restart-engine").click().run()
    assert len(launched) == 2
    assert settle(at, lambda: bool(at.get("progress")))


def test_a_prompt_submitted_before_the_engine_is_up_is_sent_once_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    at = _app(monkeypatch, f"ws://127.0.0.1:{port}")
    at.run()
    assert not connected(at)
    at.text_area(key="prompt_text").input("Is anybody there?")
    at.button(key="FormSubmitter:prompt-Submit").click().run()
    assert any("held" in t for t in texts(at.success))
    assert not texts(at.error)
    assert settle(at, lambda: any("held until the engine is" in t for t in texts(at.caption)))
    with AppPeer(port=port) as late:  # the engine comes up on that port
        assert late.wait_for(lambda: len(late.received("submit")) == 1, timeout=20)
        assert late.received("submit")[0]["prompt"] == "Is anybody there?"
        assert settle(at, lambda: any("requests 0" in t for t in texts(at.caption)))
        # the held notice gives way to what became of the prompt
        assert settle(at, lambda: any("submitted: request 0" in t for t in texts(at.success)))
        assert not any("held" in t and "starting" in t for t in texts(at.success))
