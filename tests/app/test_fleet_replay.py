"""Fleet recordings (one trace per replica, engine.server.fleet --trace-dir): loading a folder,
aligning its replicas on one clock by `clock_epoch`, moving them together, their figures from the
shared fold, comparing two fleets; and the page (AppTest) replaying one: both replicas drawn,
every control disabled with the reason, the scrubber moving both, the comparison table. The
traces are made by the in-test protocol peer's scheduler (tests/app/app_peer.py): no model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from app.fleet_replay import (
    FIGURES,
    FLEET,
    FleetRecording,
    FleetReplay,
    compare_rows,
    trace_dir_from,
)
from app.replay import ReplaySource
from instrumentation import messages
from instrumentation.fold import summarize
from tests.app.app_peer import SimEngine

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "app" / "main.py")
EPOCH = 1_765_000_000.0
T0 = 5.0  # each engine's clock when its recording starts (an engine is up before it records)


def record_replica(path: Path, epoch: float | None, n: int, cached: int, seed: int) -> None:
    """A replica's --trace: its hello (with `clock_epoch`), then `n` requests run to the end;
    each admitted prompt finds `cached` of its tokens in the prefix cache."""
    sim = SimEngine(max_extend_tokens=24)
    sim.now = T0
    engine = {"model": "sim", "instance": f"r{seed}"}
    if epoch is not None:
        engine["clock_epoch"] = epoch
    out = [messages.hello(T0, engine, dict(sim.config), {"steps": [], "requests": []})]
    for k in range(n):
        out += sim.submit(prompt_len=30 + 9 * k + seed, max_tokens=5 + k)[1]
    while sim.busy:
        out += sim.step()
    for seq, msg in enumerate(out[1:]):
        msg["seq"] = seq
        if msg.get("event") == "admitted":
            msg["cached_len"] = cached
    path.write_text("".join(json.dumps(m) + "\n" for m in out))


def make_fleet(folder: Path, epochs: list[float | None], cached: int = 8) -> Path:
    folder.mkdir(parents=True)
    for i, epoch in enumerate(epochs):
        record_replica(folder / f"replica-{i}.jsonl", epoch, 3 + i, cached, i)
    return folder


@pytest.fixture
def fleet_dir(tmp_path: Path) -> Path:
    # replica 1's engine started 0.3 s after replica 0's: its clock reads 0.3 s behind
    return make_fleet(tmp_path / "a", [EPOCH, EPOCH + 0.3])


def published(source: ReplaySource) -> list[float]:
    return [s["t1"] for s in source.store.snapshot().steps]


# ---- loading ----------------------------------------------------------------------------------


def test_a_fleet_recording_loads_its_replicas_on_one_clock(fleet_dir: Path, tmp_path: Path) -> None:
    fleet = FleetRecording.load(fleet_dir)
    assert fleet.numbers == (0, 1) and fleet.names == ["replica 0", "replica 1"]
    assert fleet.offsets == pytest.approx((0.0, 0.3)) and fleet.aligned
    ends = [r.times[-1] + off for r, off in zip(fleet.recordings, fleet.offsets, strict=True)]
    assert fleet.start == T0 and fleet.end == pytest.approx(max(ends))
    # a trace without clock_epoch (an older server) is drawn on its own clock, and said so
    old = FleetRecording.load(make_fleet(tmp_path / "old", [EPOCH, None]))
    assert old.offsets == (0.0, 0.0) and not old.aligned

    for bad, words in (
        (tmp_path / "missing", "is not a folder"),
        (fleet_dir / "replica-0.jsonl", "is not a folder"),
        (tmp_path, "holds no replica-<i>.jsonl"),
    ):
        with pytest.raises(ValueError, match=words):
            FleetRecording.load(bad)
    broken = make_fleet(tmp_path / "broken", [EPOCH])
    (broken / "replica-1.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="replica-1.jsonl: .*no protocol messages"):
        FleetRecording.load(broken)

    assert trace_dir_from(["--fleet-trace", "D"], {}) == "D"
    assert trace_dir_from(["--fleet-trace=E"], {"STEPSCOPE_FLEET_TRACE": "F"}) == "E"
    assert trace_dir_from([], {"STEPSCOPE_FLEET_TRACE": "F"}) == "F"
    assert trace_dir_from(["--trace", "x"], {}) is None


# ---- moving together --------------------------------------------------------------------------


def test_a_seek_shows_each_replica_as_it_stood_at_that_fleet_time(fleet_dir: Path) -> None:
    fleet = FleetRecording.load(fleet_dir)
    replay = FleetReplay(fleet, threaded=False)
    whole = [ReplaySource(r, threaded=False) for r in fleet.recordings]
    for src in whole:
        src.seek_end()
    # opened at the end: every replica whole
    for src, full in zip(replay.sources, whole, strict=True):
        assert src.store.snapshot().steps == full.store.snapshot().steps
    all_t1 = [[s["t1"] for s in full.store.snapshot().steps] for full in whole]
    for t in (T0 + 0.05, T0 + 0.2, T0 + 0.31, (T0 + fleet.end) / 2, T0):  # and back (a rewind)
        gen = replay.generation
        replay.seek(t)
        assert replay.position == pytest.approx(t) and replay.generation == gen + 1
        for src, off, times in zip(replay.sources, fleet.offsets, all_t1, strict=True):
            shown = published(src)
            assert shown == [x for x in times if x + off <= t], (t, off)
    # before replica 1's first step, it shows none of its steps while replica 0 shows some
    replay.seek(fleet.recordings[0].times[fleet.recordings[0].step_at[1]])
    assert published(replay.sources[0]) and not published(replay.sources[1])
    # the scrubber's own move keeps the generation (its widget already shows the time)
    gen = replay.generation
    replay.seek(T0 + 0.1, moved_here=True)
    assert replay.generation == gen
    replay.seek(fleet.end + 5)
    assert replay.position == fleet.end and replay.at_end
    replay.seek(0.0)  # before the recording: its start
    assert replay.position == fleet.start == T0


def test_playing_moves_every_replica_on_the_fleets_clock(fleet_dir: Path) -> None:
    fleet = FleetRecording.load(fleet_dir)
    wall = [100.0]
    replay = FleetReplay(fleet, clock=lambda: wall[0], threaded=False)
    replay.play(10)  # at the end: plays again from the start
    assert replay.playing and replay.position == fleet.start and replay.speed == 10
    wall[0] += 0.02  # 0.2 s of the recording at 10x
    replay.tick()
    assert replay.position == pytest.approx(T0 + 0.2)
    for src, off in zip(replay.sources, fleet.offsets, strict=True):
        assert all(t + off <= T0 + 0.2 for t in published(src))
    replay.pause()
    wall[0] += 1.0
    replay.tick()  # paused: nothing moves
    assert replay.position == pytest.approx(T0 + 0.2) and not replay.playing
    replay.play(50)
    wall[0] += 100.0
    replay.tick()
    assert replay.at_end and not replay.playing
    with pytest.raises(ValueError, match="speed"):
        replay.set_speed(100)


# ---- the figures ------------------------------------------------------------------------------


def test_the_figures_are_the_shared_folds(fleet_dir: Path, tmp_path: Path) -> None:
    fleet = FleetRecording.load(fleet_dir)
    for rec, s in zip(fleet.recordings, fleet.summaries, strict=True):
        assert s == summarize(rec.messages)
    total, parts = fleet.total, fleet.summaries
    assert total.requests == sum(s.requests for s in parts) == 3 + 4
    assert total.output_tokens == sum(s.output_tokens for s in parts)
    assert total.steps == sum(s.steps for s in parts)
    # the span runs on the fleet's clock: from replica 0's first step to the later last step
    pairs = list(zip(fleet.recordings, fleet.offsets, strict=True))
    starts = [r.messages[r.step_at[0]]["t0"] + off for r, off in pairs]
    ends = [r.messages[r.step_at[-1]]["t1"] + off for r, off in pairs]
    assert total.duration_s == pytest.approx(max(ends) - min(starts))
    assert total.output_tok_s == pytest.approx(total.output_tokens / total.duration_s)
    hit = total.prefix_hit_rate
    assert hit is not None and 0 < hit < 1 and max(s.ttft_p50_s or 0 for s in parts) > 0

    other = FleetRecording.load(make_fleet(tmp_path / "b", [EPOCH, EPOCH, EPOCH], cached=0))
    rows = compare_rows(fleet, other)
    whos = [r["replica"] for r in rows]
    assert whos == [w for w in ("replica 0", "replica 1", "replica 2", FLEET)
                    for _ in FIGURES]  # fmt: skip
    by = {(r["replica"], r["figure"]): r for r in rows}
    for who, sa, sb in (("replica 0", parts[0], other.summaries[0]), (FLEET, total, other.total)):
        for label, name in FIGURES:
            row = by[(who, label)]
            assert row["A"] == getattr(sa, name) and row["B"] == getattr(sb, name)
    assert by[(FLEET, "requests")]["B − A"] == other.total.requests - total.requests == 12 - 7
    assert by[("replica 0", "prefix-cache hit rate")]["B"] == 0.0
    assert (
        by[("replica 2", "requests")]["A"] is None
        and by[("replica 2", "requests")]["B − A"] is None
    )


# ---- the page ---------------------------------------------------------------------------------


@pytest.fixture
def fleet_app(fleet_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AppTest]:
    monkeypatch.setenv("STEPSCOPE_URL", "ws://127.0.0.1:9,ws://127.0.0.1:10")  # never contacted
    monkeypatch.setenv("STEPSCOPE_AUTOSTART", "0")
    monkeypatch.setenv("STEPSCOPE_FLEET_TRACE", str(fleet_dir))
    at = AppTest.from_file(APP, default_timeout=60)
    yield at
    st.cache_resource.clear()


def _charts(at: AppTest) -> list[dict]:
    """The charts' payloads on the page, in order."""
    out = []
    for e in at.get("bidi_component"):
        data = json.loads(e.proto.json)
        if e.proto.component_name == "stepscope.live" and data.get("mode", "charts") == "charts":
            out.append(data)
    return out


def test_the_page_replays_a_fleet_recording_with_its_controls_disabled(
    fleet_app: AppTest, fleet_dir: Path, tmp_path: Path
) -> None:
    at = fleet_app.run()
    assert not at.exception, at.exception
    assert any("a fleet recording of 2 replicas" in m.value for m in at.markdown)
    assert [m.value for m in at.markdown if m.value.startswith("#### ")] == [
        "#### replica 0 · `replica-0.jsonl`",
        "#### replica 1 · `replica-1.jsonl`",
    ]
    charts = _charts(at)
    assert len(charts) == 2  # both replicas drawn
    fleet = FleetRecording.load(fleet_dir)
    for data, rec, off in zip(charts, fleet.recordings, fleet.offsets, strict=True):
        assert data["steps"]["step"] == list(rec.step_numbers)  # each whole, at the end
        # on one clock, one scale: the fleet's time span, this replica's times shifted onto it
        assert data["axes"]["time"]["x"] == pytest.approx([fleet.start, fleet.end])
        assert data["link"] == "fleet-replay"
        first = rec.messages[rec.step_at[0]]
        assert data["steps"]["t0"][0] == pytest.approx(first["t0"] + off)
    # every control that cannot act is disabled, with the reason
    assert at.selectbox(key="fleet_target").disabled
    assert at.select_slider(key="fleet_budget").disabled
    assert at.radio(key="fleet_policy").disabled
    assert at.text_area(key="fleet_prompt").disabled
    assert at.number_input(key="fleet_max").disabled
    reasons = [c.value for c in at.caption if "a replay has no engine" in c.value]
    assert len(reasons) == 2  # the controls' and the prompt form's
    # the summary: a row per replica and the fleet's, over the whole recording
    table = at.dataframe[0].value
    assert list(table["replica"]) == ["replica 0", "replica 1", FLEET]
    assert list(table["requests"]) == [3, 4, 7]
    assert any("whole recording" in c.value for c in at.caption)

    # the scrubber reads the fleet's clock, as the charts' x axis: both replicas shown as they
    # stood at 0.2 s after the first step
    [scrubber] = [s for s in at.slider if s.key and s.key.startswith("fleet_replay_t_")]
    assert (scrubber.min, scrubber.max) == (T0, pytest.approx(fleet.end, abs=0.01))
    scrubber.set_value(T0 + 0.2).run()
    assert not at.exception, at.exception
    for data, rec, off in zip(_charts(at), fleet.recordings, fleet.offsets, strict=True):
        want = [rec.messages[i]["step"] for i in rec.step_at
                if rec.messages[i]["t1"] + off <= T0 + 0.2]  # fmt: skip
        assert data["steps"]["step"] == want
    assert len(want) < fleet.recordings[1].num_steps

    # play: every replica moves on together from the start, to the end
    at.select_slider(key="fleet_replay_speed").set_value(50).run()
    at.button(key="fleet_replay_play").click().run()
    assert not at.exception, at.exception
    from app.page.fleet_recording import fleet_replay

    replay = fleet_replay(str(fleet_dir.resolve()))
    assert replay.speed == 50
    deadline = time.monotonic() + 30
    while not replay.at_end and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replay.at_end and not replay.playing
    at.run()
    assert any("at the end" in c.value for c in at.caption)

    # compare with a second fleet recording
    other = make_fleet(tmp_path / "b", [EPOCH, EPOCH], cached=0)
    at.text_input(key="fleet_compare_path").set_value(str(other)).run()
    assert not at.exception, at.exception
    assert any("Compare fleet recordings" in m.value for m in at.markdown)
    compared = at.dataframe[1].value
    assert list(compared.columns) == ["replica", "figure", "A", "B", "B − A"]
    fleet_rows = compared[compared["replica"] == FLEET]
    assert list(fleet_rows["figure"]) == [label for label, _ in FIGURES]

    # a folder that is no fleet recording, typed in the sidebar: a clear error
    at.text_input(key="fleet_trace_path").set_value(str(tmp_path / "nothing")).run()
    assert not at.exception, at.exception
    assert any("is not a folder" in e.value for e in at.error)
