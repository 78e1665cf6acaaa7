"""The dashboard's non-visual parts: event store, engine link, launcher, commands, export."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app import controls, export
from app.client import EngineLink, NotConnected, valid_url
from app.launcher import (
    EngineProcess,
    Launcher,
    engine_argv,
    local_port,
    parse_progress,
    should_autostart,
)
from app.state import EventStore
from tests.app.app_peer import AppPeer, SimEngine

ROOT = Path(__file__).resolve().parents[2]


def wait_until(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    """Poll until true; the timeout only bounds a failing test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def hello(now: float, steps: list[dict], requests: list[dict] | None = None) -> dict:
    return {
        "type": "hello",
        "protocol": 1,
        "now": now,
        "engine": {"model": "m", "page_size": 1},
        "config": {"max_extend_tokens": 16, "policy": "prefill_first"},
        "history": {"steps": steps, "requests": requests or []},
    }


def sim_messages(n_steps: int) -> list[dict]:
    sim = SimEngine(max_extend_tokens=8)
    msgs = sim.submit(20, 4)[1] + sim.submit(5, 3)[1]
    while sim.busy and sum(m["type"] == "step" for m in msgs) < n_steps:
        msgs += sim.step()
    return msgs


# ---- event store ------------------------------------------------------------------------------


def test_store_folds_request_and_token_events_into_records() -> None:
    store = EventStore()
    for msg in sim_messages(100):
        store.apply(msg)
    snap = store.snapshot()
    recs = {r["uid"]: r for r in snap.requests}
    assert recs[0]["state"] == "finished" and recs[0]["output_len"] == 4
    assert recs[0]["text"] == "the sea was calm"
    assert recs[0]["t_first_token"] is not None and recs[0]["prompt_len"] == 20
    assert [s["step"] for s in snap.steps] == list(range(len(snap.steps)))


def test_store_reconnect_to_the_same_engine_keeps_old_steps_and_adds_history() -> None:
    store = EventStore()
    steps = [m for m in sim_messages(8) if m["type"] == "step"]
    store.apply(hello(0.0, []))
    for s in steps[:5]:
        store.apply(s)
    # reconnected: the server's history overlaps what we saw and continues past it
    store.apply(hello(steps[-1]["t1"] + 1, steps[3:], [{"uid": 0, "state": "finished"}]))
    snap = store.snapshot()
    assert [s["step"] for s in snap.steps] == [s["step"] for s in steps]
    assert snap.requests[0]["state"] == "finished"


def test_store_starts_afresh_when_the_engine_restarted() -> None:
    store = EventStore()
    store.apply(hello(0.0, []))
    for s in [m for m in sim_messages(8) if m["type"] == "step"]:
        store.apply(s)
    store.apply(hello(0.01, []))  # a clock behind what we saw: a new engine process
    assert store.snapshot().steps == []
    assert [m["type"] for m in store.log()] == ["hello"]


def test_store_clear_forgets_ended_requests_even_after_a_reconnect() -> None:
    store = EventStore()
    msgs = sim_messages(100)
    for msg in msgs:
        store.apply(msg)
    steps = [m for m in msgs if m["type"] == "step"]
    store.clear()
    assert store.snapshot().steps == [] and store.snapshot().requests == []
    store.apply(hello(steps[-1]["t1"] + 1, steps, [{"uid": 0, "state": "finished"}]))
    assert store.snapshot().steps == [] and store.snapshot().requests == []


def test_store_keeps_a_bounded_window_and_answers_replies() -> None:
    store = EventStore(max_steps=3)
    steps = [m for m in sim_messages(10) if m["type"] == "step"]
    assert len(steps) > 3
    for s in steps:
        store.apply(s)
    assert store.snapshot().steps == steps[-3:]
    assert len(store.snapshot(last_steps=2).steps) == 2
    store.apply({"type": "accepted", "id": "a1", "uid": 7})
    assert store.wait_reply("a1", 0)["uid"] == 7
    assert store.wait_reply("missing", 0) is None


# ---- engine link ------------------------------------------------------------------------------


def test_link_sends_commands_and_receives_replies_and_events() -> None:
    with AppPeer() as peer:
        link = EngineLink(peer.url).start()
        try:
            assert wait_until(lambda: link.status().state == "connected")
            reply = link.request({"type": "submit", "prompt": "hello there", "max_tokens": 3})
            assert reply is not None and reply["type"] == "accepted"
            assert peer.received("submit")[0]["id"] == reply["id"]
            assert wait_until(lambda: link.store.snapshot().requests[0]["state"] == "finished")
            bad = link.request({"type": "submit", "prompt": ""})
            assert bad is not None and bad["code"] == "invalid_request"
        finally:
            link.close()
    assert link.status().state == "closed"


def test_link_reconnects_and_the_hello_history_redraws_the_past() -> None:
    with AppPeer() as first:
        port = first.port
        link = EngineLink(first.url, retry_s=0.05).start()
        assert wait_until(lambda: link.status().state == "connected")
    assert wait_until(lambda: link.status().state == "unreachable")
    with pytest.raises(NotConnected):
        link.send({"type": "abort", "uid": 0})
    # The same engine comes back with steps the link never saw live.
    with AppPeer(port=port, tick_s=3600) as second:
        second.sim.now = 100.0
        second.sim.submit(10, 2)
        second.steps += [m for m in (second.sim.step() + second.sim.step()) if m["type"] == "step"]
        try:
            assert wait_until(lambda: len(link.store.snapshot().steps) == 2)
            assert link.status().ever_connected and link.status().state == "connected"
            assert link.store.snapshot().requests[0]["state"] == "finished"
        finally:
            link.close()


def test_link_reports_why_nothing_answers() -> None:
    with AppPeer() as peer:
        url = peer.url
    link = EngineLink(url, retry_s=0.05).start()
    try:
        assert wait_until(lambda: link.status().failed_attempts >= 2)
        assert "connection refused" in (link.status().error or "")
        assert not link.status().ever_connected
    finally:
        link.close()


def test_valid_url() -> None:
    assert valid_url("ws://127.0.0.1:8765") is None
    assert "ws://" in (valid_url("http://127.0.0.1:8765") or "")


# ---- commands ---------------------------------------------------------------------------------


def test_commands_are_validated_before_they_go_out() -> None:
    assert controls.submit("hi", 3, 0.5, True, True) == {
        "type": "submit",
        "prompt": "hi",
        "max_tokens": 3,
        "temperature": 0.5,
        "chat": True,
        "ignore_eos": True,
    }
    with pytest.raises(ValueError, match="empty"):
        controls.submit("   ")
    with pytest.raises(ValueError, match="max_tokens"):
        controls.submit("hi", 0)
    with pytest.raises(ValueError, match="temperature"):
        controls.submit("hi", 3, -1)
    assert controls.set_config(1) == {"type": "set_config", "max_extend_tokens": 1}
    with pytest.raises(ValueError):
        controls.set_config(0)
    with pytest.raises(ValueError, match="policy"):
        controls.set_config(policy="fastest")
    assert len(controls.submit_copies(controls.submit("x"), 3)) == 3
    assert controls.abort(4) == {"type": "abort", "uid": 4}


def test_budget_options_reach_one_and_include_the_exact_value() -> None:
    assert controls.budget_options()[:3] == [1, 2, 4] and controls.budget_options()[-1] == 8192
    assert 100 in controls.budget_options(100)


def test_replies_are_described_for_the_status_line() -> None:
    assert controls.describe_reply({"type": "accepted", "uid": 3}) == (
        True,
        "accepted as request 3",
    )
    ok, text = controls.describe_reply({"type": "error", "code": "too_large", "message": "no"})
    assert not ok and "too_large" in text
    assert controls.describe_reply(None)[0] is False


# ---- launcher ---------------------------------------------------------------------------------


def test_engine_command_and_local_ports() -> None:
    argv = engine_argv(9000, "smollm2")
    assert argv[:3] == [sys.executable, "-m", "engine.server"]
    assert argv[argv.index("--port") + 1] == "9000"
    assert local_port("ws://127.0.0.1:8765") == 8765
    assert local_port("ws://localhost/") == 80
    assert local_port("ws://example.com:8765") is None


def test_progress_lines_are_parsed() -> None:
    p = parse_progress("loading weights:  62%|██████▏   | 168/272 [00:00<00:00, 403.85tensor/s]")
    assert p is not None and p.label == "loading weights" and p.fraction == pytest.approx(0.62)
    assert parse_progress("stepscope: loading smollm2 on cpu ...") is None


def test_autostart_only_for_a_local_url_that_never_answered() -> None:
    assert should_autostart("ws://127.0.0.1:8765", False, 1, True, False)
    assert not should_autostart("ws://127.0.0.1:8765", False, 0, True, False)  # still trying
    assert not should_autostart("ws://127.0.0.1:8765", True, 3, True, False)  # it died: ask
    assert not should_autostart("ws://10.0.0.5:8765", False, 3, True, False)
    assert not should_autostart("ws://127.0.0.1:8765", False, 3, False, False)
    assert not should_autostart("ws://127.0.0.1:8765", False, 3, True, True)


FAKE_ENGINE = textwrap.dedent(
    """
    import sys, time
    print("stepscope: loading fake on cpu ...", flush=True)
    sys.stdout.write("loading weights:  50%|#####     | 1/2\\r"); sys.stdout.flush()
    sys.stdout.write("loading weights: 100%|##########| 2/2\\n"); sys.stdout.flush()
    print("stepscope engine ready at ws://127.0.0.1:1", flush=True)
    sys.exit(int(sys.argv[1]))
    """
)


def test_engine_process_reports_progress_readiness_and_exit() -> None:
    proc = EngineProcess([sys.executable, "-c", FAKE_ENGINE, "3"]).start()
    assert wait_until(lambda: proc.state == "exited")
    assert proc.returncode == 3
    assert proc.ready_url == "ws://127.0.0.1:1"
    assert proc.progress is not None and proc.progress.fraction == 1.0
    assert proc.tail(2) == [
        "loading weights: 100%|##########| 2/2",
        "stepscope engine ready at ws://127.0.0.1:1",
    ]


def test_launcher_starts_once_and_restarts_on_request() -> None:
    launcher = Launcher()
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    first = launcher.start(sleeper)
    assert launcher.start(sleeper) is first  # still running: not started twice
    second = launcher.restart(sleeper)
    assert second is not first and first.state == "exited"
    launcher.stop()
    assert wait_until(lambda: second.state == "exited")


# ---- export -----------------------------------------------------------------------------------


def test_chrome_trace_export_has_a_track_per_request_and_counts_each_step_once() -> None:
    msgs = sim_messages(100)
    steps = [m for m in msgs if m["type"] == "step"]
    # a reconnect's hello repeats steps already received live
    log = [hello(0, []), *msgs, hello(99, steps[-3:])]
    trace = json.loads(export.chrome_trace_bytes(log))
    events = trace["traceEvents"]
    step_slices = [e for e in events if e["ph"] == "X" and e.get("cat") == "step"]
    assert len(step_slices) == len(steps)
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"request 0", "request 1", "engine steps"} <= tracks
    chunks = [e["name"] for e in events if e["ph"] == "X" and e.get("tid") == 0]
    assert "chunk [0:8)" in chunks and "decode" in chunks
    lines = export.jsonl_bytes(log).decode().splitlines()
    assert len(lines) == len(log) and json.loads(lines[1]) == msgs[0]


# ---- dependency direction ---------------------------------------------------------------------


def test_the_app_never_imports_torch_or_the_engine() -> None:
    # instrumentation.metrics (pure functions: the metric definitions the engine's `finished` event and
    # the shared fold both use) is the one engine module the app may reach, through the fold
    code = (
        "import sys; import app.client, app.controls, app.derive, app.export, app.compare, "
        "app.launcher, app.panels, app.session, app.state, app.sweep_view, app.workloads; "
        "ok = {'engine', 'instrumentation.metrics'}; "
        "bad = [m for m in sys.modules if m not in ok and "
        "(m == 'torch' or m.startswith(('torch.', 'engine')))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_app_session_reaches_the_session_state() -> None:
    """app/session.py owns every `st.session_state` key (typed `Field`s); the other modules go
    through it, so a key is spelled once and what it holds is declared once."""
    app_dir = ROOT / "app"
    reaching = sorted(
        str(path.relative_to(ROOT))
        for path in app_dir.rglob("*.py")
        if path != app_dir / "session.py" and "session_state" in path.read_text()
    )
    assert reaching == []
    assert "st.session_state" in (app_dir / "session.py").read_text()  # the grep looks right


def test_session_fields_have_one_key_each() -> None:
    from app import session

    fields = [f for f in vars(session).values() if isinstance(f, session.Field)]
    fields += list(session.STALE.values())
    keys = [f.key for f in fields]
    assert len(fields) > 40 and len(keys) == len(set(keys))


def test_snapshot_of_zero_steps_has_none_and_delta_is_incremental() -> None:
    store = EventStore()
    store.apply({"type": "hello", "protocol": 1, "seq": -1, "now": 0.0,
                 "engine": {"instance": "i"}, "config": {},
                 "history": {"steps": [], "requests": []}})  # fmt: skip
    for n in range(5):
        store.apply({"type": "step", "seq": n, "step": n, "t0": n, "t1": n + 0.5, "items": []})
    assert store.snapshot(last_steps=0).steps == []
    assert [s["step"] for s in store.snapshot(last_steps=2).steps] == [3, 4]
    d = store.delta(None)
    assert d.reset and len(d.steps) == 5
    store.apply({"type": "step", "seq": 5, "step": 5, "t0": 5, "t1": 5.5, "items": []})
    store.apply({"type": "request", "seq": 6, "uid": 9, "event": "queued", "t": 5.6,
                 "prompt_len": 3, "max_tokens": 2})  # fmt: skip
    d2 = store.delta(d.cursor)
    assert not d2.reset and [s["step"] for s in d2.steps] == [5]
    assert [r["uid"] for r in d2.requests] == [9]
    assert store.delta(d2.cursor).steps == [] and store.delta(d2.cursor).requests == []
