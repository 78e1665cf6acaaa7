"""The named delay in the page's headline, tables and figures (app.delays, app.delays_view), on
the protocol peer's simulated engine, whose step times are a formula: the chapter's case (four
chats decode, a 300-token prompt chunked 64 a step under prefill-first) and a queue that waits
for the budget, then the pool. A replayed recording gives the same figures; a watched engine's
steps say what prompt work added to its decodes; the store keeps ended requests' waits within
its bound."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app import delays
from app.derive import headline
from app.replay import Recording, ReplaySource
from instrumentation.blame import blame, step_interference
from tests.app.app_peer import SimEngine
from tests.app.test_delay_payload import chapter, fed, hello

Message = dict[str, Any]


def queue_run() -> list[Message]:
    """Budget 16, two 40-token prompts: request 1 waits while request 0 is chunked (the steps
    say the queue's head waits for the budget, then for the pool)."""
    sim = SimEngine(max_extend_tokens=16)
    msgs = [hello(sim), *sim.submit(40, 2)[1], *sim.submit(40, 2)[1]]
    while sim.busy:
        msgs += sim.step()
    for m in msgs:
        if m["type"] == "step":
            m["queue"]["waiting_reason"] = {0: "budget", 1: "kv"}.get(m["step"])
    return msgs


# ---- the headline -----------------------------------------------------------------------------


def test_the_worst_stall_names_its_main_cause() -> None:
    store = fed(chapter())
    snap = store.snapshot()
    h = headline(snap.steps, snap.requests)
    assert (h.worst_stall, h.worst_stall_uid, h.worst_stall_ongoing) == (pytest.approx(0.74), 0,
                                                                         False)  # fmt: skip
    cause = store.stall_cause(h.summary, 0, h.worst_stall, False)
    assert cause is not None and cause.phrase == "740 ms — mostly request 4's prompt"
    assert cause.share == pytest.approx(0.70 / 0.74)


def test_a_stall_still_going_on_names_what_it_waits_for_so_far() -> None:
    msgs = chapter()
    cut = next(i for i, m in enumerate(msgs) if m["type"] == "step" and m["step"] == 9)
    store = fed(msgs[:cut])  # through step 8: the chats have waited three chunks
    snap = store.snapshot()
    h = headline(snap.steps, snap.requests)
    assert h.worst_stall_ongoing and h.worst_stall == pytest.approx(0.444)
    assert h.summary.worst_stall_s is None  # no token ended a stall yet
    cause = store.stall_cause(h.summary, h.worst_stall_uid, h.worst_stall, True)  # type: ignore[arg-type]
    assert cause is not None and cause.phrase == "444 ms — mostly request 4's prompt"


def test_the_headline_row_says_the_cause() -> None:
    from streamlit.testing.v1 import AppTest

    def page() -> None:
        from app import panels
        from tests.app.test_delay_payload import chapter, fed

        store = fed(chapter())
        panels.metrics_row(store.snapshot(), causes=store)

    at = AppTest.from_function(page, default_timeout=30).run()
    assert not at.exception
    caption = at.caption[0].value
    assert caption.endswith("Worst stall: **740 ms — mostly request 4's prompt** (request 0).")


# ---- the requests table -----------------------------------------------------------------------


def test_the_requests_table_splits_the_wait_by_reason() -> None:
    per = fed(queue_run()).delays()
    assert delays.reasons_in(per) == ["budget", "kv"]
    # steps 0 and 1 chunk request 0 (16 tokens: 20 + 32 ms each) while request 1 waits; step 2
    # runs both prompts' next 8 tokens (52 ms, 26 each by tokens); then request 1's two chunks
    # (52 ms each) and a decode step of two (28 ms) are its own
    assert delays.wait_columns(per[1], ["budget", "kv"]) == {
        "waited: budget (s)": 0.052, "waited: kv (s)": 0.052, "own (s)": 0.158,
        "by others (s)": 0.026, "most delayed by": "request 0 (0.026 s)",
    }  # fmt: skip
    assert delays.wait_columns(per[0], ["budget", "kv"])["waited: budget (s)"] == 0


def test_the_requests_view_draws_the_columns() -> None:
    from streamlit.testing.v1 import AppTest

    def page() -> None:
        from types import SimpleNamespace

        from app import panels
        from tests.app.test_delay_payload import fed
        from tests.app.test_delay_views import queue_run

        store = fed(queue_run())
        panels.requests_view(SimpleNamespace(store=store), store.snapshot())  # type: ignore[arg-type]

    at = AppTest.from_function(page, default_timeout=30).run()
    assert not at.exception
    table = at.dataframe[0].value
    row = table[table["uid"] == 1].iloc[0]
    assert (row["waited: budget (s)"], row["waited: kv (s)"]) == (0.052, 0.052)
    assert row["most delayed by"] == "request 0 (0.026 s)"


# ---- the Delays tab ---------------------------------------------------------------------------


def test_the_delays_figures_name_the_long_prompt() -> None:
    per = fed(chapter()).delays()
    fig = delays.request_figure(per)
    long = next(t for t in fig.data if t.name == "request 4's work")
    assert list(long.y[:4]) == ["req 0", "req 1", "req 2", "req 3"]
    assert list(long.x[:4]) == [0.7] * 4  # the five chunk steps, whole, for every chat
    run = blame(per)
    causes = {label: s for label, s, _ in delays.run_causes(run)}
    assert causes["request 4's work"] == pytest.approx(2.8)
    assert sum(causes.values()) == pytest.approx(run.latency)
    rows = delays.pair_rows(run, per)
    assert rows[0]["culprit"] == "request 4" and rows[0]["seconds"] == 0.7
    assert delays.culprit_rows(run)[0] == {
        "request": "request 4", "cost the others (s)": 2.8, "requests it delayed": 4
    }  # fmt: skip


def test_under_mixed_the_long_prompt_costs_only_what_its_chunks_added() -> None:
    """Five mixed steps carry the chats' decodes and 60 tokens of the prompt each (20 + 120 +
    16 ms): a decode-only step of four takes 36 ms, so each chat is charged 120 ms a step."""
    per = fed(chapter("mixed")).delays()
    assert all(per[u].by[4] == pytest.approx(5 * 0.120) for u in range(4))
    assert all(per[u].own > per[u].by[4] for u in range(4))


def test_the_delays_tab_draws_its_figures_and_tables() -> None:
    from streamlit.testing.v1 import AppTest

    def page() -> None:
        from app import delays_view
        from app.state import EventStore
        from tests.app.test_delay_payload import chapter, fed

        delays_view.delays_tab(fed(chapter()))
        delays_view.delays_tab(EventStore())  # nothing yet: it says so

    at = AppTest.from_function(page, default_timeout=30).run()
    assert not at.exception
    assert len(at.get("plotly_chart")) == 2 and len(at.dataframe) == 2
    pairs = at.dataframe[0].value
    assert list(pairs.iloc[0]) == ["request 4", "request 0", 0.7, "42%"]
    assert "No request has a named delay yet" in at.info[0].value


# ---- replay: the same figures as live ---------------------------------------------------------


def test_a_replay_shows_the_figures_the_live_page_showed() -> None:
    from app.live.feed import LiveFeed, ViewOptions

    msgs = chapter()
    live = fed(msgs)
    source = ReplaySource(Recording.from_messages(msgs, "run.jsonl"), threaded=False)
    source.seek_end()
    replayed = source.store
    assert {u: d.to_dict() for u, d in replayed.delays().items()} == {
        u: d.to_dict() for u, d in live.delays().items()
    }
    opts = ViewOptions(window=500, xmode="step")
    assert (
        LiveFeed().payload(replayed, None, opts)["waits"]
        == (LiveFeed().payload(live, None, opts)["waits"])
    )
    snap = replayed.snapshot()
    h = headline(snap.steps, snap.requests, whole=True)
    cause = replayed.stall_cause(h.summary, h.worst_stall_uid, h.worst_stall, False)  # type: ignore[arg-type]
    assert cause is not None and cause.phrase == "740 ms — mostly request 4's prompt"


# ---- a watched engine -------------------------------------------------------------------------


def test_watched_steps_say_what_prompt_work_added_and_what_cannot_be_told() -> None:
    steps = [{"step": n, "t0": n * 0.02, "t1": (n + 1) * 0.02, "phase": "decode",
              "decode_requests": 4, "items": []} for n in range(3)]  # fmt: skip
    steps.append({"step": 3, "t0": 0.06, "t1": 0.11, "phase": "mixed", "decode_requests": 4,
                  "prompt_tokens": 512, "items": []})  # fmt: skip
    steps.append({"step": 4, "t0": 0.11, "t1": 0.11, "phase": "prefill", "prompt_tokens": 64,
                  "items": []})  # fmt: skip
    items = step_interference(steps)
    fig = delays.interference_figure(items)
    bars = fig.data[0]
    assert list(bars.x) == [0, 1, 2, 3] and list(bars.y) == [0, 0, 0, 30.0]
    caption = fig.layout.meta
    assert caption == delays.interference_caption(items)
    assert "30 ms added in 4 steps told" in caption and "names no request" in caption
    assert "1 step(s) not estimated: no time of its own" in caption


def test_the_watched_page_draws_the_figure_under_its_charts() -> None:
    from streamlit.testing.v1 import AppTest

    def page() -> None:
        from app import panels
        from app.state import Snapshot

        steps = [{"step": n, "t0": n * 0.02, "t1": (n + 1) * 0.02, "phase": "mixed",
                  "decode_requests": 4, "prompt_tokens": 64 * (n % 2), "items": [],
                  "source": "vllm-fpm"} for n in range(6)]  # fmt: skip
        panels.external_charts(Snapshot(steps, [], {"external": True}, None, 1))

    at = AppTest.from_function(page, default_timeout=30).run()
    assert not at.exception
    assert [m.value for m in at.markdown] == ["**What prompt work added to the decodes**"]
    fig = json.loads(at.get("plotly_chart")[-1].proto.spec)
    assert fig["layout"]["yaxis"]["title"]["text"] == "ms added to the decodes"
    assert any("names no request" in c.value for c in at.caption)


# ---- memory ----------------------------------------------------------------------------------


def test_only_the_newest_ended_requests_keep_their_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Token by token waits cost a few hundred bytes each: the store keeps those of the newest
    ended requests (MAX_KEPT_WAITS of them); older ones keep their Delay, and the fold's byte
    count stays what its records hold."""
    monkeypatch.setattr("app.state.MAX_KEPT_WAITS", 30)
    store = fed(chapter())  # the long prompt's 4 tokens end first, then the chats' 24 each
    fold = store._fold
    kept = {r.uid: len(r.delay_gaps or ()) for r in fold.requests()}
    assert kept == {0: 0, 1: 0, 2: 0, 3: 24, 4: 0}
    assert all(r.delay is not None for r in fold.requests())
    assert fold.ended_bytes == sum(r.approx_bytes() for r in fold.requests())
