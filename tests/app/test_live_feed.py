"""The live feed (app.live.feed) across the page's own changes: a pause, a remount while paused,
a narrower or wider window, a cleared history. Runs without a browser, against an EventStore
fed as a connection feeds it (tests/app/test_app_live.py's `Engine`)."""

from __future__ import annotations

from app.live.feed import LiveFeed, ViewOptions
from tests.app.test_app_live import Engine

LIVE = ViewOptions(window=50, xmode="step")
PAUSED = ViewOptions(window=50, xmode="step", paused=True)


def _numbers(payload: dict) -> list[int]:
    steps = payload.get("steps", {}).get("step", [])
    return steps if isinstance(steps, list) else [steps]


def test_a_view_mounted_afresh_while_paused_gets_the_frozen_view() -> None:
    eng, feed = Engine(), LiveFeed()
    eng.steps(80)
    drawn = feed.payload(eng.store, None, LIVE)  # what the page showed when it was paused
    eng.steps(7)  # the engine runs on while the charts are frozen
    eng.send({"type": "request", "uid": 9, "event": "queued", "t": 86.0, "prompt_len": 5})
    # the view that drew `drawn` is still there: it keeps it, and no steps travel
    kept = feed.payload(eng.store, drawn["id"], PAUSED)
    assert kept["paused"] and kept["id"] == drawn["id"] and "steps" not in kept
    # the pause banner moved the charts: a new view, holding nothing, asks from nothing
    fresh = feed.payload(eng.store, None, PAUSED)
    assert fresh["reset"] and fresh["paused"]
    assert _numbers(fresh) == list(range(30, 80))  # every step in view, as it was frozen
    assert all(r[0] != 9 for r in fresh.get("requests", []))  # queued after the freeze
    # it shows what the other view showed, so a second remount gets the same
    assert _numbers(feed.payload(eng.store, None, PAUSED)) == list(range(30, 80))
    # resuming from the frozen view misses nothing the engine did meanwhile
    resumed = feed.payload(eng.store, fresh["id"], LIVE)
    assert not resumed.get("reset") and _numbers(resumed) == list(range(80, 87))
    assert [r[0] for r in resumed.get("requests", [])] == [9]


def test_a_narrower_window_holds_for_every_batch_the_browser_may_ask_from() -> None:
    eng, feed = Engine(), LiveFeed()
    eng.steps(80)
    a = feed.payload(eng.store, None, LIVE)
    eng.steps(2)
    b = feed.payload(eng.store, a["id"], LIVE)  # the browser holds `b`
    # the slider moved to 20 steps; a full run answers from an older batch
    narrow = feed.payload(eng.store, a["id"], ViewOptions(window=20, xmode="step"))
    assert narrow["window"] == 20  # the browser drops what is past it at once
    # back to 50, asked from the browser's own batch: it dropped those steps, so a reset
    wide = feed.payload(eng.store, b["id"], LIVE)
    assert wide["reset"] and _numbers(wide) == list(range(32, 82))
    assert wide["history"] == a["history"]  # the same history: the browser keeps the zoom


def test_a_paused_view_given_a_wider_window_gets_more_of_the_frozen_view() -> None:
    eng, feed = Engine(), LiveFeed()
    eng.steps(120)
    a = feed.payload(eng.store, None, LIVE)
    eng.steps(5)
    narrower = feed.payload(eng.store, a["id"], ViewOptions(30, "step", paused=True))
    assert narrower["id"] == a["id"] and narrower["window"] == 30 and "steps" not in narrower
    wider = feed.payload(eng.store, a["id"], ViewOptions(100, "step", paused=True))
    assert wider["reset"] and wider["paused"] and _numbers(wider) == list(range(20, 120))


def test_a_replaced_history_tells_the_browser_to_drop_its_zoom() -> None:
    eng, feed = Engine(), LiveFeed()
    eng.steps(60)
    a = feed.payload(eng.store, None, LIVE)
    eng.steps(3)
    b = feed.payload(eng.store, a["id"], LIVE)
    assert not b.get("reset")
    eng.store.clear()  # Clear history: the next run is not where the old zoom was
    eng.steps(7)
    cleared = feed.payload(eng.store, b["id"], LIVE)
    assert cleared["reset"] and cleared["history"] != a["history"]
    assert _numbers(cleared) == list(range(63, 70))
    eng.steps(1)
    after = feed.payload(eng.store, cleared["id"], LIVE)
    assert not after.get("reset")
    # a view this feed does not know (a remount) is drawn the same history again, even when
    # the feed's bookkeeping is older than what the browser drew; another source is another
    unknown = feed.payload(eng.store, 12345, LIVE)
    assert unknown["reset"] and unknown["history"] == cleared["history"]
    other = Engine()
    other.steps(5)
    assert feed.payload(other.store, None, LIVE)["history"] != cleared["history"]
    # cleared while paused: the frozen view is gone with the history
    eng.store.clear()
    paused = feed.payload(eng.store, after["id"], PAUSED)
    assert paused["reset"] and paused["history"] != cleared["history"] and _numbers(paused) == []
