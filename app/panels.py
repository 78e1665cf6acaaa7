"""The page's views: metric row, charts, KV page map, requests; a comparison and a sweep.

Every chart of a stepscope engine's steps is the `app.live` component, drawn in the browser:
live and replayed steps from new steps only, a compared recording whole, the sweep's trade-off
plot. The other views draw from a bounded snapshot in fragments that rerun every second while
their tab is open. An external engine's aggregate steps and tensor-parallel ranks are plotly
figures (app.aggregate, app.ranks), memoized per tab on the data's version.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Protocol

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app import aggregate, compare, controls, delays, external, ranks, session, sweep_view
from app.client import EngineLink, NotConnected
from app.derive import Headline, headline
from app.kvmap import PageMapStore
from app.live.component import kv_page_map, recording_charts, sweep_plot
from app.live.component import live_charts as _live_charts
from app.live.feed import ViewOptions
from app.live.style import request_color
from app.state import Message, Snapshot
from app.workloads import PresetRun
from instrumentation.blame import StallCause, step_interference
from instrumentation.fold import Summary

PLOT_CONFIG = {"displaylogo": False, "scrollZoom": False}
LATENCY_STEPS = 2_000  # the requests table and the ranks read at most this many steps
PAGE_MAP_WAIT_S = 0.5
OUTPUT_HEIGHT_PX = 420

TIMELINE_CAPTION = (
    "Each bar is one engine step, stacked by request (a request keeps its colour in every "
    "chart). **Hatched**: prompt tokens; a `chunk` leaves the prompt unfinished, the `prefill` "
    "piece finishes it and samples the first token. **Solid**: one decode token. **Dashed**: "
    "`max_extend_tokens`, which bounds a step's prompt tokens. Below, one lane per request: "
    "grey waiting, hatched chunks labelled `[start:end)`, solid decoding, **red** stalls."
)
POLICY_CAPTIONS = {
    "prefill_first": (
        "Now **prefill-first**: a step runs one kind only, so no request decodes while a prompt "
        "is chunked (red): “there is no decode at all while the long prompt is being prefilled "
        "in chunks” (“Chunked prefill”, *mini-sglang from Scratch*, Stage 2, *The cost*)."
    ),
    "mixed": (
        "Now **mixed** (stall-free batching, Sarathi-Serve): every running request decodes one "
        "token each step and what is left of the budget goes to prompt chunks, so decode never "
        "stalls; a step carrying a chunk is only slower."
    ),
}
KV_CAPTION = (
    "The paged KV pool, in pages: **used** by requests in flight, **cached** only by the prefix "
    "cache (evictable; a repeated prompt prefix is served from it), **free**. The dotted line is "
    "what admitted requests are promised but have not computed yet (remaining prompt plus "
    "remaining max_tokens under **reserve** admission; under **optimistic**, their outputs times "
    "new_token_ratio, an estimate that jumps up after a retraction), converted from tokens to "
    "pages. **Red triangles**: the pool was full (a decode found no page left and requests were "
    "retracted). Chunking bounds how much a single step allocates, not how much a prompt needs."
)
PROGRESS_CAPTION = (
    "Tokens generated so far, all requests (black) and each request (its colour). A **flat "
    "stretch is a generation stall**: the engine computed prompt chunks and no running request "
    "got a token (the picture of Sarathi-Serve's generation stalls). Under mixed the line keeps "
    "climbing."
)
PAGE_MAP_CAPTION = (
    "The KV pool as pages, one cell each, read from the engine while this tab is open: a "
    "request's pages in its colour, **shared prefix pages** (prefix-cache hits, held by the "
    "radix tree and used by this request) with a white diagonal, **cached** pages no request "
    "holds (evictable), **free** pages grey, and pages promised to admitted requests but not "
    "yet allocated outlined. Abort a request and its cells return within one update."
)
ITL_CAPTION = (
    "Time from each request's previous token to this one, at the step that sampled it. **Red "
    "points** ended a stall: the request was running but steps ran without it. The tail of this "
    "is what a chatting user feels as a freeze."
)
SWEEP_CAPTION = (
    "One point per run, TTFT p50 against the tail you pick, one line per policy through its "
    "token budgets (labelled). Pooled ITL p99 hides stalls: a policy can have the lowest ITL p99 "
    "and the longest stall, so worst stall is the first view. Open markers: the run has no value "
    "(no stall at all). Every figure is the shared fold's summary of the run's trace (summary.csv)."
    " **Click a point to open that run.**"
)


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def chart(name: str, key: tuple, build: Callable[[], go.Figure]) -> go.Figure:
    """Draw a figure, rebuilding it only when its inputs changed since this tab last drew it."""
    memo = session.FIGURE_MEMO.setdefault()
    hit = memo.get(name)
    if hit is None or hit[0] != key:
        hit = memo[name] = (key, build())
    st.plotly_chart(hit[1], key=f"chart-{name}", config=PLOT_CONFIG)
    return hit[1]


def _memo_key(snap: Snapshot, *extra: object) -> tuple:
    first = snap.steps[0]["step"] if snap.steps else None
    return (snap.version, len(snap.steps), first, *extra)


# ---- metric row -------------------------------------------------------------------------------


class StallCauses(Protocol):
    """Where the headline finds its worst stall's cause (app.state.EventStore)."""

    def stall_cause(
        self, summary: Summary, uid: int, seconds: float, ongoing: bool
    ) -> StallCause | None: ...


def metrics_row(
    snap: Snapshot, whole: bool | None = None, causes: StallCauses | None = None
) -> None:
    """The headline: the shared fold's Summary over the steps in `snap` (app.derive.headline),
    with a caption that says which steps those are (`whole`: they are the whole recording) and
    what the worst stall waited for (from `causes`, instrumentation.blame's phrase)."""
    h = headline(snap.steps, snap.requests, whole)
    external = aggregate.any_aggregate(snap.steps)
    if external:  # counts only: the engine's own rates, and no per-request facts
        h = aggregate.headline(snap.steps, h)
    # widths for what each shows: the ITL and worst-stall lines below their values are the longest
    # (equal columns cut "p99.9 67.…" at 1,600 px with the sidebar open)
    cols = st.columns([1, 1.1, 1.7, 1.6, 1.1, 1, 1.1])
    cols[0].metric("tokens / s", "–" if h.tokens_per_s is None else f"{h.tokens_per_s:.1f}",
                   help="Generated tokens per second over the steps the caption names.")  # fmt: skip
    itl_tail = None if h.itl_p99 is None else f"p99 {_seconds(h.itl_p99)}"
    if itl_tail is not None and h.itl_p999 is not None:
        itl_tail += f" · p99.9 {_seconds(h.itl_p999)}"
    ttft_tail = None if h.ttft_p99 is None else f"p99 {_seconds(h.ttft_p99)}"
    for col, name, p50, tail, what in (
        (cols[1], "TTFT", h.ttft_p50, ttft_tail, "Time to first token: queued to first token."),
        (cols[2], "ITL", h.itl_p50, itl_tail, "Inter-token latency: gaps between a request's "
         "tokens, every request pooled."),
    ):  # fmt: skip
        col.metric(
            f"{name} p50",
            _seconds(p50),
            delta=tail,
            delta_color="off",
            delta_arrow="off",
            help=what,
        )
    worst = "–" if external else "none" if h.worst_stall is None else _seconds(h.worst_stall)
    notes = [] if h.worst_stall_uid is None else [f"request {h.worst_stall_uid}"]
    if h.stalled_now:
        notes.append(f"{h.stalled_now} stalled now, {_seconds(h.stalled_now_s)}")
    cols[3].metric(
        "worst stall",
        worst,
        delta=" · ".join(notes) or None,
        delta_color="red",
        delta_arrow="off",
        help="The longest stall: a gap between two of a request's tokens during which at "
        "least one step ran without it (docs/protocol.md). Stalled now: running requests "
        "left out of the steps since their last token; their wait becomes a stall when their "
        "next token comes.",
    )
    kv = "–" if h.kv_used is None else f"{h.kv_used:.1%}"
    cached = None if h.kv_cached is None else f"+ {h.kv_cached:.1%} cached"
    cols[4].metric(
        "KV used",
        kv,
        delta=cached,
        delta_color="off",
        delta_arrow="off",
        help="Share of the pool's pages held by requests in flight, plus the prefix cache's.",
    )
    cols[5].metric("running / waiting", f"{h.running} / {h.waiting}")
    last = snap.steps[-1] if snap.steps else None
    cols[6].metric(
        "last step",
        "–" if last is None else f"#{last['step']}",
        delta=None if last is None else _last_step_note(last),
        delta_color="off",
        delta_arrow="off",
    )
    if external:
        st.caption(f"Over {h.scope}; tokens/s and KV as the engine logged them.")
    else:
        st.caption(f"Tokens/s, TTFT, ITL and worst stall over {h.scope}." + _cause_line(h, causes))


def _cause_line(h: Headline, causes: StallCauses | None) -> str:
    """ " Worst stall: 4.46 s — mostly request 4's prompt (request 1)." where a cause is known."""
    if causes is None or h.worst_stall is None or h.worst_stall_uid is None:
        return ""
    cause = causes.stall_cause(h.summary, h.worst_stall_uid, h.worst_stall, h.worst_stall_ongoing)
    if cause is None or cause.main is None:
        return ""
    who = f"request {cause.uid}" + (", still waiting" if h.worst_stall_ongoing else "")
    return f" Worst stall: **{cause.phrase}** ({who})."


def _last_step_note(last: Message) -> str:
    """Phase and budget; an external source may not log the budget (then it is not shown)."""
    budget = last.get("budget")
    note = str(last.get("phase", "?")) + ("" if budget is None else f" · budget {budget}")
    sample = last.get("sample_of_steps")
    return note + (f" · sample of {sample} steps" if sample and sample > 1 else "")


def delivery_notice(snap: Snapshot) -> None:
    """Say when the record is not the whole truth: lost messages, or a new engine."""
    seen = session.RESTARTS_SEEN.get()
    if seen is None or snap.restarts > seen:
        session.RESTARTS_SEEN.set(snap.restarts)
    if seen is not None and snap.restarts > seen:
        session.notify(False, "The engine restarted: the page now shows the new engine's record.")
    if snap.lost:
        st.warning(
            f"{snap.lost:,} message(s) from the engine were lost while this page fell behind; "
            f"it resynced from the engine's history ({snap.resyncs} time(s)), so the charts are "
            "whole again, but events in the gaps may be missing from the trace.",
            icon=":material/sync_problem:",
        )


def run_line(run: PresetRun) -> None:
    """One workload (or held prompt) run: how far it got, and what it waits for."""
    total = len(run.preset.actions)
    line = f"{run.preset.title}: {run.done_actions}/{total} steps sent"
    if run.uids:
        line += f" · requests {', '.join(map(str, run.uids))}"
    if run.waiting_for:
        line += f" · {run.waiting_for}"
    done = run.finished and not run.errors
    st.caption((":material/check_circle: " if done else ":material/play_circle: ") + line)
    for err in run.errors:
        st.error(f"{run.preset.title}: {err}")


# ---- live charts ------------------------------------------------------------------------------


def captions(policy: str | None) -> dict[str, str]:
    return {
        "timeline": TIMELINE_CAPTION + " " + POLICY_CAPTIONS.get(policy or "", ""),
        "kv": KV_CAPTION,
        "progress": PROGRESS_CAPTION,
        "latency": ITL_CAPTION,
    }


def live_charts(link: EngineLink, hidden: bool = False) -> None:
    window = session.window_steps() or session.ALL_STEPS
    opts = ViewOptions(window=window, xmode=session.XMODE.get(), paused=not session.is_live())
    _live_charts(link.store, "charts", opts, captions, hidden=hidden)


# ---- KV page map ------------------------------------------------------------------------------


def page_map_view(link: EngineLink) -> None:
    """Ask for the pool page by page (only while this tab is open) and draw the answer."""
    st.caption(PAGE_MAP_CAPTION)
    store = link.store
    if not isinstance(store, PageMapStore):
        st.info("This connection's store does not keep page maps.")
        return
    message = ""
    if session.is_live():
        try:
            command_id = link.send(controls.kv_map())
            store.wait_page_map(command_id, PAGE_MAP_WAIT_S)
            refused = store.reply(command_id)  # an engine without the extension says so
            if refused is not None and refused.get("type") == "error":
                message = f"The engine sends no page map: {refused.get('message')}"
        except NotConnected as exc:
            message = f"No page map: {exc}"
    kv_page_map("kvmap", None if message else store.page_map(), message)


def outputs_view(requests: Sequence[Message], limit: int = 8) -> None:
    """The newest requests' whole output text as it streams, in each request's colour."""
    live = [r for r in requests if r.get("state") in ("waiting", "running")]
    ended = [r for r in requests if r.get("state") not in ("waiting", "running")]
    shown = (live + ended[::-1])[:limit]
    if not shown:
        return
    rows = []
    for r in shown:
        color = request_color(int(r["uid"]))
        text = html.escape(r.get("text") or "")
        if not text:
            text = "<i style='color:#888'>(no output yet)</i>"
        rows.append(
            f"<div style='margin:4px 0;white-space:pre-wrap'><span style='color:{color};"
            f"font-weight:600'>■ req {r['uid']}</span> <span style='color:#888'>"
            f"{r.get('state')}</span> · {text}</div>"
        )
    st.markdown("**Output as it streams**")
    with st.container(height=OUTPUT_HEIGHT_PX):  # whole answers: long ones scroll here
        st.markdown("\n".join(rows), unsafe_allow_html=True)


# ---- requests ---------------------------------------------------------------------------------


def _abort(link: EngineLink, uid: int) -> None:
    session.send(
        link, controls.abort(uid), f"abort request {uid}", toast=True
    )  # v1.1 acknowledges it


def waiting_reason(steps: list[Message]) -> str | None:
    """Why the head of the waiting queue was not admitted in the latest step (the protocol's
    `queue.waiting_reason`; None when nothing waited)."""
    return (steps[-1].get("queue") or {}).get("waiting_reason") if steps else None


def request_source(record: Message) -> str:
    """Where a request came from: "http" (the OpenAI API), else the page's WebSocket."""
    return str(record.get("source") or "ws/page")


def requests_view(link: EngineLink, snap: Snapshot, abort_note: str | None = None) -> None:
    """The requests table; `abort_note` (an external engine's reason) disables Abort."""
    live = [r for r in snap.requests if r.get("state") in ("waiting", "running")]
    reason = waiting_reason(snap.steps)
    if reason is not None and any(r.get("state") == "waiting" for r in live):
        st.caption(
            "Why requests wait: the head of the queue was not admitted in the last step for "
            f"**{controls.WAIT_REASON_TEXT.get(reason, reason)}** (admission is FIFO: the "
            "others wait behind it)."
        )
    if live:
        st.markdown("**In flight**")
    for r in live:
        uid = int(r["uid"])
        color = request_color(uid)
        c1, c2, c3 = st.columns([1.2, 6, 1])
        state = str(r["state"])
        if state == "waiting" and reason is not None:
            state += f" ({reason})"
        c1.markdown(
            f"<span style='color:{color};font-weight:600'>■ req {uid}</span> · {state}",
            unsafe_allow_html=True,
        )
        done = int(r.get("output_len") or 0)
        c2.caption(
            f"{done}/{r.get('max_tokens') or '?'} tokens · prompt {r.get('prompt_len') or '?'}"
            f" · {html.escape((r.get('text') or '')[-160:])}"
        )
        c3.button(
            "Abort",
            key=f"abort-{uid}",
            on_click=_abort,
            args=(link, uid),
            help=abort_note or f"Send abort for request {uid}",
            disabled=abort_note is not None,
        )
    if not snap.requests:
        st.info("No requests yet.")
        return
    per = link.store.delays()  # who delayed each request, and why it waited (app.delays)
    reasons = delays.reasons_in(per)
    rows = []
    for r in snap.requests[::-1]:
        tq, tf, te = r.get("t_queued"), r.get("t_first_token"), r.get("t_finished")
        stall = (r.get("metrics") or {}).get("max_stall_seconds")  # the protocol's stall
        rows.append(
            {
                "uid": r["uid"],
                "source": request_source(r),
                "state": r.get("state"),
                "waits for": reason if r.get("state") == "waiting" else None,
                "retracted": r.get("retractions") or 0,
                "prompt": r.get("prompt_len"),
                "cached": r.get("cached_len"),
                "output": r.get("output_len"),
                "max_tokens": r.get("max_tokens"),
                "TTFT (s)": None if tf is None or tq is None else round(tf - tq, 3),
                "latency (s)": None if te is None or tq is None else round(te - tq, 3),
                "worst stall (s)": None if stall is None else round(stall, 3),
                **delays.wait_columns(per.get(int(r["uid"])), reasons),
                "text": r.get("text") or r.get("message") or "",
            }
        )
    st.dataframe(
        pd.DataFrame(rows),
        hide_index=True,
        height=min(600, 40 + 35 * len(rows)),
        column_config={"text": st.column_config.TextColumn("text", width="large",
                       help="The whole output: double-click a cell to read all of it.")},
    )  # fmt: skip


# ---- external engines and tensor-parallel ranks -----------------------------------------------


def external_charts(snap: Snapshot) -> None:
    """An external engine's steps: one lane per data-parallel rank (a filter keeps one rank in
    every figure), aggregate composition, KV usage, queue, throughput, and its KV events."""
    xmode = session.XMODE.get()
    ranks_seen = external.dp_ranks(snap.steps, snap.kv_events)
    rank = None
    if len(ranks_seen) > 1:
        choice = st.radio("Data-parallel rank", [external.ALL_RANKS, *ranks_seen],
                          horizontal=True, key="dp_rank_filter")  # fmt: skip
        rank = None if choice == external.ALL_RANKS else int(choice)
    steps, kv = external.of_rank(snap.steps, rank), external.of_rank(snap.kv_events, rank)
    for note in (external.time_note(steps), external.kv_gap_note(kv)):
        if note:
            st.caption(note)
    chart("rank_lanes", _memo_key(snap, xmode, rank),
          lambda: external.rank_lanes_figure(steps, xmode))  # fmt: skip
    st.caption(aggregate.NO_LANES_CAPTION)
    chart(
        "aggregate",
        _memo_key(snap, xmode, rank),
        lambda: aggregate.aggregate_figure(steps, xmode),
    )
    if any(s.get("prompt_tokens") for s in steps):  # prompt work that may have slowed decodes
        st.markdown("**What prompt work added to the decodes**")
        fig = chart("interference", _memo_key(snap, xmode, rank),
                    lambda: delays.interference_figure(step_interference(steps), xmode))  # fmt: skip
        st.caption(fig.layout.meta)  # the figure's own account of what it could not tell
    if kv:
        st.markdown("**Prefix cache (KV events)**")
        st.caption(aggregate.KV_EVENTS_CAPTION)
        last = kv[-1].get("kv_seq")
        chart(
            "kv_events",
            _memo_key(snap, xmode, len(kv), last, rank),
            lambda: aggregate.kv_events_figure(kv, steps, xmode),
        )
        hits = external.kv_hit_rate_figure(kv)
        if hits is not None:
            chart("kv_hit_rate", _memo_key(snap, len(kv), last, rank), lambda: hits)


def ranks_view(steps: Sequence[Message], engine: dict | None) -> None:
    """Each tensor-parallel rank's forward time per step (drawn only when steps carry ranks)."""
    if not any(s.get("ranks") for s in steps):
        return
    tp = ranks.tp_caption(engine or {}) or "tensor parallel"
    numbers, series = ranks.rank_series(steps)
    slow = ranks.slowest_rank(series)
    note = "" if slow is None else f" · slowest on average: rank {slow}"
    st.markdown(f"**Ranks** ({tp}{note})")
    st.caption(
        "Forward time per rank per step (solid) and its all-reduce share (dotted): a rank whose "
        "line sits above the others is a straggler every other rank waits for."
    )
    chart(
        "ranks", (len(steps), numbers[-1] if numbers else None), lambda: ranks.ranks_figure(steps)
    )


# ---- a comparison and a sweep -----------------------------------------------------------------


def compare_charts(a: compare.Side, b: compare.Side, xmode: str) -> None:
    """Two recordings' charts, one above the other, each drawn whole on the same axes (zooming
    one zooms both)."""
    axes = compare.axes(a, b)
    for label, side in (("A", a), ("B", b)):
        recording_charts(
            f"compare_{label.lower()}",
            compare.record(side),
            title=compare.title(label, side),
            axes=axes,
            link="compare",
            xmode=xmode,
            captions=captions(side.policy),
        )


def sweep_chart(sweep: sweep_view.SweepFolder, on_select: Callable[[], None]) -> None:
    """The sweep's trade-off plot; a click on a point calls `on_select` (the run it names is
    `sweep_view.selected_run(sweep, session.SWEEP_CHART.get())`)."""
    sweep_plot(
        session.SWEEP_CHART.key,
        sweep_view.points(sweep),
        sweep.title,
        SWEEP_CAPTION,
        on_select=on_select,
    )
