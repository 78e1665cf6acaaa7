"""Replay, compare and sweep in the page: a recording folded through the same store as live draws
the same charts (the live component's batches); the cursor seeks, plays and rewinds; two runs
compare on aligned axes; a sweep folder's points name their runs. AppTest renders the page from a
replay; a browser opens a recording through the sidebar, scrubs, and opens the second run of a
comparison."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from app import compare, sweep_view
from app.live.feed import LiveFeed, ViewOptions
from app.replay import MAX_SPEED, Recording, ReplayLink, ReplaySource
from app.state import EventStore
from instrumentation.fold import summarize
from instrumentation.sweep import RunTrace, SweepRow, summary_row, write_summary
from instrumentation.trace import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "app" / "main.py")


# ---- recordings: two runs of one workload on the tiny model -------------------------------------


def _record(llm: object, policy: str, path: Path) -> EventStore:
    """Run a small workload under `policy`, writing its trace; returns a store fed live (each
    message as it is produced, as the page's connection feeds it)."""
    from engine.workload import Arrival

    llm.set_config(max_extend_tokens=16, policy=policy)  # type: ignore[attr-defined]
    arrivals = [Arrival(0.0, 40, 10), Arrival(0.0, 12, 14), Arrival(0.02, 70, 6),
                Arrival(0.05, 24, 9), Arrival(0.3, 33, 5)]  # fmt: skip
    prompts = [[1000 + 7 * i + j for j in range(a.prompt_len)] for i, a in enumerate(arrivals)]
    trace = RunTrace(path, llm.info.to_dict(), llm.config_dict(), llm.now())  # type: ignore[attr-defined]
    live = EventStore()
    live.apply(_header(trace, path))  # the same hello the file starts with

    def tee(event: object) -> None:
        msg = event.to_dict()  # type: ignore[attr-defined]
        trace(msg)  # numbers it (seq) and writes it
        live.apply(msg)

    llm.add_event_hook(tee)  # type: ignore[attr-defined]
    try:
        _run_arrivals(llm, arrivals, prompts)
    finally:
        llm.remove_event_hook(tee)
        trace.close()
    return live


def _run_arrivals(llm: object, arrivals: list, prompts: list[list[int]]) -> None:
    """Submit each request when its time comes (open loop, as the sweep replays a workload) and
    step until all have finished."""
    from instrumentation.sampling import SamplingParams

    start, i = time.perf_counter(), 0
    while i < len(arrivals) or llm.has_work():  # type: ignore[attr-defined]
        now = time.perf_counter() - start
        while i < len(arrivals) and arrivals[i].t <= now:
            params = SamplingParams(max_tokens=arrivals[i].output_len, ignore_eos=True)
            llm.submit(prompts[i], params)  # type: ignore[attr-defined]
            i += 1
        if llm.has_work():  # type: ignore[attr-defined]
            llm.step()  # type: ignore[attr-defined]
        elif i < len(arrivals):
            time.sleep(min(0.05, max(0.0, arrivals[i].t - now)))


def _header(trace: RunTrace, path: Path) -> dict:
    trace.writer._file.flush()
    return json.loads(path.read_text().splitlines()[0])


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return record_runs(tiny_llama_dir, tmp_path_factory.mktemp("runs"))


def record_runs(tiny_llama_dir: Path, out: Path) -> dict:
    """Two recordings of one workload (prefill-first, mixed) and their sweep folder, in `out`."""
    from engine.llm import LLM

    llm = LLM(str(tiny_llama_dir), device="cpu", cache_type="naive", progress=False)
    a = _record(llm, "prefill_first", out / "prefill_first-16.jsonl")
    b = _record(llm, "mixed", out / "mixed-16.jsonl")
    rows = [
        sweep_row("prefill_first", out / "prefill_first-16.jsonl"),
        sweep_row("mixed", out / "mixed-16.jsonl"),
    ]
    write_summary(out / "summary.csv", rows)
    return {"dir": out, "a": out / "prefill_first-16.jsonl", "b": out / "mixed-16.jsonl",
            "live_a": a, "live_b": b}  # fmt: skip


def sweep_row(policy: str, path: Path) -> SweepRow:
    return summary_row(policy, 16, read_jsonl(path))


def _charts(store: EventStore, window: int = 500) -> dict:
    """What the live charts would send a newly opened browser from this store (app/live), less
    the history's name (it names the store drawn from)."""
    out = LiveFeed().payload(store, None, ViewOptions(window=window, xmode="step"))
    out.pop("history")
    return out


# ---- the fold: replay draws what live drew ------------------------------------------------------


def test_replay_fed_store_draws_the_same_figures_as_the_live_fed_one(runs: dict) -> None:
    for side in ("a", "b"):
        source = ReplaySource(Recording.load(runs[side]), threaded=False)
        source.seek_end()
        live, replayed = runs[f"live_{side}"].snapshot(), source.store.snapshot()
        assert replayed.steps == live.steps and replayed.requests == live.requests
        assert replayed.engine == live.engine and replayed.config == live.config
        assert _charts(source.store) == _charts(runs[f"live_{side}"])


def test_seek_shows_the_recording_as_it_stood_at_that_step(runs: dict) -> None:
    rec = Recording.load(runs["a"])
    msgs = rec.messages
    source = ReplaySource(rec, threaded=False)
    mid = rec.step_numbers[len(rec.step_numbers) // 2]
    source.seek(mid)
    assert source.current_step == mid
    # the same as a store fed every message up to the next step message
    upto = EventStore()
    nxt = next(i for i, m in enumerate(msgs) if m["type"] == "step" and m["step"] > mid)
    for m in msgs[:nxt]:
        upto.apply(m)
    assert source.store.snapshot().steps == upto.snapshot().steps
    assert source.store.snapshot().requests == upto.snapshot().requests
    assert source.store.snapshot().steps[-1]["step"] == mid
    # backwards: the store is rewound, and a view's cursor from before gets a reset
    cursor = source.store.delta(None).cursor
    source.seek(rec.first_step)
    assert source.current_step == rec.first_step and len(source.store.snapshot().steps) == 1
    assert source.store.delta(cursor).reset
    # forwards again to the end: the whole recording
    source.seek(rec.last_step)
    assert source.at_end
    assert source.store.snapshot().requests == runs["live_a"].snapshot().requests


def test_play_follows_the_recordings_clock_at_the_speed_asked(runs: dict) -> None:
    rec = Recording.load(runs["a"])
    now = [100.0]
    source = ReplaySource(rec, clock=lambda: now[0], threaded=False)
    source.seek(rec.first_step)
    t_start = source.current_time
    source.play(speed=10)
    assert source.tick() == 0  # no time passed
    span = rec.times[-1] - t_start
    now[0] += span / 10 / 2  # half the remaining recording, at 10x
    source.tick()
    assert source.playing and not source.at_end
    reached = source.current_time - t_start
    # every message up to half-way is folded, none after: the time of the last one at or before
    # it (how close that is to half-way depends on how far apart the recorded steps were)
    half = t_start + span / 2
    assert source.current_time == max(t for t in rec.times if t <= half + 1e-9)
    assert reached <= 0.5 * span + 1e-9 and all(t > half for t in rec.times[source._pos :])
    source.pause()
    now[0] += 1000.0
    assert source.tick() == 0 and source.current_time - t_start == reached  # paused: stays
    with pytest.raises(ValueError):
        source.set_speed(MAX_SPEED * 2)
    source.play(speed=MAX_SPEED)
    now[0] += span  # far past the end
    source.tick()
    assert source.at_end and not source.playing


def test_a_replay_link_refuses_commands(runs: dict) -> None:
    from app.client import NotConnected

    link = ReplayLink(ReplaySource(Recording.load(runs["a"]), threaded=False))
    assert link.status().state == "connected" and link.url.startswith("replay:")
    with pytest.raises(NotConnected):
        link.send({"type": "submit", "prompt": "x"})


def test_a_page_download_replays_like_the_server_trace(runs: dict, tmp_path: Path) -> None:
    """The page's Trace (JSONL) download is the store's log: hellos included."""
    from app.export import jsonl_bytes

    path = tmp_path / "download.jsonl"
    path.write_bytes(jsonl_bytes(runs["live_a"].log()))
    source = ReplaySource(Recording.load(path), threaded=False)
    source.seek_end()
    assert source.store.snapshot().steps == runs["live_a"].snapshot().steps


# ---- compare and sweep --------------------------------------------------------------------------


def test_compare_aligns_the_axes_and_tabulates_the_difference(runs: dict) -> None:
    a, b = compare.side(Recording.load(runs["a"])), compare.side(Recording.load(runs["b"]))
    assert a.steps[0]["t0"] == 0 and b.steps[0]["t0"] == 0 and a.steps[0]["step"] == 0
    axes = compare.axes(a, b)  # both charts get these
    hi = max(a.steps[-1]["t1"], b.steps[-1]["t1"])
    assert axes["time"]["x"] == [0.0, pytest.approx(hi)]
    last = max(a.steps[-1]["step"], b.steps[-1]["step"])
    assert axes["step"]["x"] == [-0.5, last + 0.5]
    assert axes["step"]["y_top"] >= 16  # the budget line of either
    for side in (a, b):  # each drawn whole, in one batch
        batch = compare.record(side).batch("time")
        assert batch["reset"] and batch["steps"]["step"] == [s["step"] for s in side.steps]
    rows = {r["metric"]: r for r in compare.table(a, b)}
    sa = summarize(Recording.load(runs["a"]).messages)
    sb = summarize(Recording.load(runs["b"]).messages)
    assert rows["ITL p99 (s)"]["A"] == sa.itl_p99_s and rows["ITL p99 (s)"]["B"] == sb.itl_p99_s
    assert rows["ITL p99 (s)"]["B − A"] == pytest.approx(sb.itl_p99_s - sa.itl_p99_s)
    assert rows["worst stall (s)"]["B"] is None  # mixed: no stall, so no difference either
    assert rows["worst stall (s)"]["B − A"] is None
    assert rows["requests"]["A"] == rows["requests"]["B"] == 5


def test_sweep_folder_points_name_their_runs(runs: dict) -> None:
    sweep = sweep_view.load(runs["dir"])
    assert set(sweep.runs) == {"prefill_first-16.jsonl", "mixed-16.jsonl"}
    points = {p["policy"]: p for p in sweep_view.points(sweep)}
    assert {k: p["run"] for k, p in points.items()} == {
        "prefill_first": "prefill_first-16.jsonl", "mixed": "mixed-16.jsonl"}  # fmt: skip
    # the y metrics the plot offers are the shared fold's summary of each run
    s = summarize(read_jsonl(runs["a"]))
    a = points["prefill_first"]
    assert (a["ttft_p50_s"], a["worst_stall_s"]) == (s.ttft_p50_s, s.worst_stall_s)
    assert (a["itl_p99_s"], a["itl_p999_s"]) == (s.itl_p99_s, s.itl_p999_s)
    # what the component reports for a click on the mixed point
    assert (
        sweep_view.selected_run(sweep, {"selected": {"run": "mixed-16.jsonl", "n": 1}}) == runs["b"]
    )
    assert sweep_view.selected_run(sweep, {"selected": {"run": "other-16.jsonl", "n": 2}}) is None
    assert sweep_view.selected_run(sweep, None) is None
    with pytest.raises(ValueError):
        sweep_view.load(runs["dir"] / "nowhere")


# ---- the page (AppTest): the views render the same figures from a replay as from live -----------


@pytest.fixture
def replay_app(runs: dict, monkeypatch: pytest.MonkeyPatch) -> Iterator[AppTest]:
    monkeypatch.setenv("STEPSCOPE_URL", "ws://127.0.0.1:9")  # never contacted while replaying
    monkeypatch.setenv("STEPSCOPE_AUTOSTART", "0")
    monkeypatch.setenv("STEPSCOPE_TRACE", str(runs["a"]))
    at = AppTest.from_file(APP, default_timeout=60)
    yield at
    st.cache_resource.clear()


def _components(at: AppTest, mode: str = "charts") -> dict[str, dict]:
    """The chart component's payloads on the page, by key, of one mode."""
    out = {}
    for e in at.get("bidi_component"):
        data = json.loads(e.proto.json)
        if e.proto.component_name == "stepscope.live" and data.get("mode", "charts") == mode:
            out[e.proto.id] = data
    return out


def _shown(at: AppTest) -> dict:
    """The live charts' batch as a newly opened browser would get it."""
    at.session_state["live_seen"] = {}
    at.run()
    assert not at.exception, at.exception
    assert not at.get("plotly_chart")  # no figure built in Python
    [data] = [d for d in _components(at).values() if not d.get("static")]
    return data


def test_the_page_replays_a_trace_through_the_live_charts(replay_app: AppTest, runs: dict) -> None:
    at = replay_app.run()
    assert not at.exception, at.exception
    assert any("replaying" in m.value for m in at.sidebar.markdown)
    got = _shown(at)
    want = _charts(runs["live_a"])  # the page's default window, from the store fed live
    for key in ("steps", "packed", "requests", "engine", "reset"):
        assert got.get(key) == want.get(key), key
    # the scrubber: step back to the first step and the charts hold only that step
    rec = Recording.load(runs["a"])
    at.slider(key="replay_step").set_value(rec.first_step).run()
    assert not at.exception, at.exception
    first = EventStore()
    for m in rec.messages[: rec.end_of_step(rec.first_step)]:
        first.apply(m)
    got, want = _shown(at), _charts(first)
    assert got["steps"]["step"] == [rec.first_step]
    assert got["packed"] == want["packed"] and got["steps"] == want["steps"]


def test_a_path_that_reached_the_box_without_its_callback_is_opened(
    replay_app: AppTest, runs: dict
) -> None:
    """A path entered while a fragment reran reached the box's value but not its on_change:
    the box showed it and nothing opened."""
    at = replay_app.run()
    assert at.session_state["replay_source"].recording.name == runs["a"].name
    at.session_state["replay_path"] = str(runs["b"])  # the value, as a fragment run leaves it
    at.run()
    assert not at.exception, at.exception
    assert at.session_state["replay_source"].recording.name == runs["b"].name


def test_an_unopened_path_asks_an_idle_page_for_the_full_run_that_opens_it() -> None:
    """On an idle page nothing else reruns the whole app: the fragment that checks whether the
    page is outdated (app/rerun.py) counts a path the box holds but nobody opened."""

    def page() -> None:
        import streamlit as st

        from app import rerun

        st.text(str(rerun.path_unopened()))

    at = AppTest.from_function(page).run()
    assert at.text[0].value == "False"  # an empty box waits for nothing
    at.session_state["replay_path"] = "/some/run.jsonl"  # as a fragment run leaves it
    assert at.run().text[0].value == "True"
    at.session_state["replay_path_tried"] = "/some/run.jsonl"  # its on_change, or the full run
    assert at.run().text[0].value == "False"


def test_opening_a_recording_drops_the_notices_of_the_page_left(
    replay_app: AppTest, runs: dict
) -> None:
    from app.session import Notice

    at = replay_app.run()
    at.session_state["notices"] = [Notice(True, "history cleared (the engine keeps running)")]
    at.run()
    assert any("history cleared" in s.value for s in at.success)  # shown while it applies
    at.text_input(key="replay_path").input(str(runs["b"])).run()
    assert not at.exception, at.exception
    assert not any("history cleared" in s.value for s in at.success)


def test_a_step_the_browser_sends_back_while_playing_does_not_move_the_replay(
    replay_app: AppTest, runs: dict
) -> None:
    """While playing, the browser sent back slider values a moment behind the replay: the
    slider's callback threw the replay back to them (to its first step, or 100 steps back), and
    one sent with Pause's click left the slider there, under a caption at the replay's step.
    Now a change from the slider drawn disabled puts it back at the replay's step, in whichever
    order the two callbacks run; paused, a scrub moves the replay."""
    rec = Recording.load(runs["a"])
    src = ReplaySource(rec, clock=lambda: 0.0, threaded=False)  # a clock that stands still
    at = replay_app.run()
    at.session_state["replay_source"] = src
    mid = rec.first_step + 5
    src.seek(mid)
    src.play(1.0)
    at.run()
    slider = at.slider(key="replay_step")
    assert slider.disabled and slider.value == mid  # moved by the replay alone
    # what the browser sends back with Pause's click (AppTest refuses a user's change to a
    # disabled widget, which this is not: the value is set as the browser's state carries it)
    slider._value = rec.first_step
    at.button(key="replay_play").click()
    at.run()
    assert not src.playing and src.current_step == mid
    assert at.slider(key="replay_step").value == mid
    at.slider(key="replay_step").set_value(rec.first_step).run()  # paused: a scrub
    assert src.current_step == rec.first_step
    assert at.slider(key="replay_step").value == rec.first_step


def test_the_page_plays_the_recording_from_its_start(replay_app: AppTest, runs: dict) -> None:
    at = replay_app.run()
    at.select_slider(key="replay_speed").set_value(50).run()
    at.button(key="replay_play").click().run()  # at the end: play starts again from step one
    assert not at.exception, at.exception
    source = at.session_state["replay_source"]
    assert source.speed == 50
    deadline = time.monotonic() + 60
    while not source.at_end and time.monotonic() < deadline:
        time.sleep(0.1)
    assert source.at_end and not source.playing
    assert source.store.snapshot().steps == runs["live_a"].snapshot().steps


def test_the_page_compares_and_opens_the_second_run(replay_app: AppTest, runs: dict) -> None:
    at = replay_app.run()
    at.text_input(key="compare_path").set_value(str(runs["b"])).run()
    assert not at.exception, at.exception
    assert any("Compare" in str(m.value) for m in at.markdown)
    table = at.dataframe[0].value
    assert list(table["metric"])[:4] == ["TTFT p50 (s)", "TTFT p99 (s)", "ITL p50 (s)",
                                         "ITL p99 (s)"]  # fmt: skip
    # two static instances of the charts, each drawn whole, on one x range; zooming one zooms both
    static = [d for d in _components(at).values() if d.get("static")]
    assert [d["title"].split(":")[0] for d in static] == ["A", "B"]
    assert static[0]["axes"] == static[1]["axes"] and {d["link"] for d in static} == {"compare"}
    assert static[1]["steps"]["step"][0] == 0  # each run from its own start
    assert not at.get("plotly_chart")
    at.button(key="compare_open_b").click().run()
    assert not at.exception, at.exception
    assert any("mixed-16.jsonl" in m.value for m in at.sidebar.markdown)


def test_the_page_opens_a_sweep_folder(replay_app: AppTest, runs: dict) -> None:
    at = replay_app.run()
    at.text_input(key="sweep_path").set_value(str(runs["dir"])).run()
    assert not at.exception, at.exception
    assert any("Sweep" in str(c.value) for c in at.caption)
    assert not at.get("plotly_chart")  # drawn by the component, not tradeoff.html's figure
    [plot] = _components(at, "sweep").values()
    assert {p["policy"] for p in plot["rows"]} == {"prefill_first", "mixed"}
    assert plot["title"].startswith("Sweep") and plot["caption"]


def test_replay_offers_no_control_that_cannot_act(replay_app: AppTest, runs: dict) -> None:
    """A recording takes no commands: its page has no prompt form, no scheduling controls, no
    workloads and no Clear history; Abort is disabled with the reason; the sidebar names the
    recording, not an engine, and says where the recorded budget and policy are shown."""
    at = replay_app.run()
    assert not at.exception, at.exception
    sidebar_md = [str(m.value) for m in at.sidebar.markdown]
    assert not any("connected" in t for t in sidebar_md), sidebar_md
    assert any("replaying" in t for t in sidebar_md), sidebar_md
    assert not [w for w in at.text_area if w.key == "prompt_text"]
    assert not [w for w in at.select_slider if w.key == "budget_slider"]
    assert not [b for b in at.sidebar.button if (b.key or "").startswith("preset-")]
    assert not [b for b in at.button if b.key == "clear_history"]
    captions = [str(c.value) for c in at.sidebar.caption]
    assert any("no engine to act on" in t for t in captions), captions
    # the budget and policy as recorded, with the step shown
    assert any("max_extend_tokens 16 · prefill-first" in str(c.value) for c in at.caption)
    # Abort, on the requests in flight at the first step
    rec = Recording.load(runs["a"])
    at.slider(key="replay_step").set_value(rec.first_step).run()
    at.session_state["detail_tab"] = "Requests"
    at.run()
    assert not at.exception, at.exception
    aborts = [b for b in at.button if (b.key or "").startswith("abort-")]
    assert aborts and all(b.disabled and "no engine to act on" in str(b.help) for b in aborts)
