"""The fleet page: several engines on one page, side by side on one clock.

A fleet is the replicas of `python -m engine.server.fleet` behind SGLang's Model Gateway, or any
list of stepscope engines: `STEPSCOPE_URL=ws://a,ws://b` (or the same list in the sidebar), or
`--fleet FILE` / `STEPSCOPE_FLEET=FILE`, the file the launcher writes (its replicas' URLs and the
gateway's). The page shows, per replica, its steps, chunk lanes, KV and waiting queue, each on
the wall clock (`hello.engine.clock_epoch`), so what the router's policy did to each replica's
batches lines up; a table sums the fleet up (requests, tokens/s, prefix-cache hit rate per
replica, from `instrumentation.fold.Summary`); the controls apply to one replica or to all; and
prompts go through the gateway when there is one, so it routes them. A fleet recording (one trace
per replica) is replayed with these same views by app/page/fleet_recording.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import streamlit as st

from app import controls, external, rerun
from app.client import EngineLink, NotConnected, valid_url
from app.fleet_replay import clock_offsets
from app.kvmap import PageMapStore
from app.live.component import LIVE_EVERY_S
from app.live.component import live_charts as _live_charts
from app.live.feed import ViewOptions
from app.panels import captions
from instrumentation.fold import Summary, summarize_steps

Message = dict[str, Any]
REFRESH_S = 1.0
WINDOW_STEPS = 600
REPLY_WAIT_S = 3.0
_TIME_FIELDS = ("t_queued", "t_admitted", "t_first_token", "t_last_token", "t_finished")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    urls: tuple[str, ...]
    gateway: str | None = None  # the gateway's base URL (its OpenAI API is under /v1)
    source: str = "STEPSCOPE_URL"


def parse_engine_urls(value: str) -> tuple[tuple[str, ...], str | None]:
    """A comma-separated list of engine URLs → the URLs, or the problem with the list, naming
    the entry at fault (an empty entry, a URL that is not ws:// or wss://, a repeat)."""
    parts = [p.strip() for p in value.split(",")]
    if any(not p for p in parts):
        return (), "The engine URL list has an empty entry: separate URLs with single commas."
    for i, part in enumerate(parts, 1):
        problem = valid_url(part)
        if problem:
            return (), f"Engine URL {i} of {len(parts)} ({part!r}): {problem}"
    if len(set(parts)) != len(parts):
        return (), "The engine URL list names one engine twice."
    return tuple(parts), None


def load_fleet_file(path: str | os.PathLike[str]) -> FleetSpec:
    """The launcher's fleet file → its replicas' WebSocket URLs and the gateway; ValueError
    with the reason when it cannot be read."""
    try:
        data = json.loads(Path(path).read_text())
        urls = tuple(str(r["ws"]) for r in data["replicas"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the fleet file {path}: {exc}") from None
    if not urls:
        raise ValueError(f"the fleet file {path} names no replicas")
    gateway = data.get("gateway")
    return FleetSpec(urls, str(gateway) if gateway else None, source=str(path))


def fleet_file_from(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """`streamlit run app/main.py -- --fleet FILE`, else STEPSCOPE_FLEET."""
    for i, arg in enumerate(argv):
        if arg == "--fleet" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--fleet="):
            return arg.split("=", 1)[1]
    return env.get("STEPSCOPE_FLEET") or None


def spec_for(
    url: str, argv: Sequence[str], env: Mapping[str, str]
) -> tuple[FleetSpec | None, str | None]:
    """The fleet to show, if the page was given one: the launcher's fleet file (`--fleet`,
    STEPSCOPE_FLEET), else a comma-separated URL list; or the problem, said plainly."""
    path = fleet_file_from(argv, env)
    if path is not None:
        try:
            return load_fleet_file(path), None
        except ValueError as exc:
            return None, str(exc)
    if "," not in url:
        return None, None
    urls, problem = parse_engine_urls(url)
    return (FleetSpec(urls) if urls else None), problem


# ---- one clock --------------------------------------------------------------------------------


class ClockShift:
    """A store seen on the fleet's clock: every step and request time moved by `offset` (this
    engine's `clock_epoch` minus the fleet's earliest). Everything else is the store's own."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.offset = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def delta(self, cursor: int | None, metrics: bool = True) -> Any:
        d = self._store.delta(cursor, metrics)
        if not self.offset:
            return d
        off = self.offset
        steps = [{**s, "t0": s["t0"] + off, "t1": s["t1"] + off} for s in d.steps]
        requests = [_shift_record(r, off) for r in d.requests]
        return replace(d, steps=steps, requests=requests)


def _shift_record(rec: Message, off: float) -> Message:
    out = dict(rec)
    for k in _TIME_FIELDS:
        if out.get(k) is not None:
            out[k] = out[k] + off
    return out


# ---- connections ------------------------------------------------------------------------------


def _close_links(links: list[EngineLink]) -> None:
    for link in links:
        link.close()


@st.cache_resource(max_entries=1, on_release=_close_links, show_spinner=False)
def fleet_links(urls: tuple[str, ...]) -> list[EngineLink]:
    """One connection per replica for the whole app process (every tab shares them)."""
    return [EngineLink(url, store=PageMapStore()).start() for url in urls]


@st.cache_resource(max_entries=1, show_spinner=False)
def _shifted(urls: tuple[str, ...]) -> list[ClockShift]:
    return [ClockShift(link.store) for link in fleet_links(urls)]


# ---- the page ---------------------------------------------------------------------------------


def replica_name(i: int) -> str:
    return f"replica {i}"


def figures(s: Summary) -> Message:
    """A Summary's figures as the fleet's tables show them."""
    return {
        "requests": s.requests,
        "output tok/s": None if s.output_tok_s is None else round(s.output_tok_s, 1),
        "prefix-cache hit rate": None if s.prefix_hit_rate is None
        else f"{s.prefix_hit_rate:.0%}",
        "TTFT p50 (s)": None if s.ttft_p50_s is None else round(s.ttft_p50_s, 3),
        "ITL p99 (s)": None if s.itl_p99_s is None else round(s.itl_p99_s, 3),
        "worst stall (s)": None if s.worst_stall_s is None else round(s.worst_stall_s, 3),
    }  # fmt: skip


def fleet_rows(links: Sequence[Any], summaries: Sequence[Summary] | None = None) -> list[Message]:
    """The fleet summary: one row per replica, its figures from the one Summary (`summaries`,
    else the window of steps the page holds for each)."""
    rows = []
    for i, link in enumerate(links):
        snap = link.store.snapshot(last_steps=WINDOW_STEPS)
        s = summaries[i] if summaries is not None else summarize_steps(snap.steps, snap.requests)
        config = snap.config or {}
        last = snap.steps[-1] if snap.steps else {}
        kv = last.get("kv") or {}
        queue = last.get("queue") or {}
        rows.append({
            "replica": replica_name(i),
            "engine": link.url,
            "state": link.status().state,
            "policy": config.get("policy"),
            "budget": config.get("max_extend_tokens"),
            "admission": config.get("admission"),
            "running": queue.get("running"),
            "waiting": queue.get("waiting"),
            "KV used": f"{kv['used'] / kv['total']:.0%}" if kv.get("total") else None,
            **figures(s),
        })  # fmt: skip
    return rows


def summary_table(links: Sequence[Any], rows: list[Message] | None = None,
                  caption: str | None = None) -> None:  # fmt: skip
    rows = fleet_rows(links) if rows is None else rows
    st.dataframe(
        [{k: v for k, v in r.items() if v is not None or k in ("requests",)} for r in rows],
        hide_index=True,
        width="stretch",
    )
    st.caption(
        caption
        or f"Each replica's figures cover the last {WINDOW_STEPS} steps the page holds for it "
        "(instrumentation.fold.Summary over that window); the prefix-cache hit rate is the "
        "share of admitted prompt tokens its radix cache served."
    )


def targets(links: Sequence[EngineLink], choice: str) -> list[tuple[int, EngineLink]]:
    if choice == "all replicas":
        return list(enumerate(links))
    i = int(choice.split()[-1])
    return [(i, links[i])]


def apply_config(links: Sequence[EngineLink], choice: str, command: Message) -> list[str]:
    """Send one set_config to the chosen replicas; a line per replica saying what it answered."""
    out = []
    for i, link in targets(links, choice):
        try:
            reply = link.request(dict(command), timeout=REPLY_WAIT_S)
        except (NotConnected, RuntimeError) as exc:
            out.append(f"{replica_name(i)}: not sent ({exc})")
            continue
        ok, msg = controls.describe_reply(reply, command)
        out.append(f"{replica_name(i)}: {msg}" if msg else f"{replica_name(i)}: applied")
        if not ok and not msg:
            out[-1] = f"{replica_name(i)}: refused"
    return out


def live_summary(links: Sequence[Any], configs_known: bool) -> None:
    """The summary, once a second; the first time every replica's config is in, the whole page
    once more, so the controls show the engines' values without a click (the first minute)."""
    if not configs_known and all(link.store.snapshot(last_steps=0).config for link in links):
        if rerun.may_ask_full_run():
            st.rerun(scope="app")
    summary_table(links)


def controls_form(links: Sequence[Any], disabled: str | None = None) -> None:
    """Budget, policy and (where the engines have it) admission, for one replica or all.
    `disabled`: why they cannot act (a replay): shown at the engines' values, read-only."""
    off = disabled is not None
    configs = [link.store.snapshot(last_steps=0).config or {} for link in links]
    names = ["all replicas"] + [replica_name(i) for i in range(len(links))]
    with st.form("fleet-config", border=True):
        c = st.columns([1.2, 2, 1.4, 1.2, 1])
        choice = c[0].selectbox("Apply to", names, key="fleet_target", disabled=off)
        first = next((cfg for cfg in configs if cfg), {})
        budget = c[1].select_slider(
            "max_extend_tokens",
            options=controls.budget_options(first.get("max_extend_tokens")),
            value=first.get("max_extend_tokens") or 256,
            key="fleet_budget",
            disabled=off,
        )
        policy = c[2].radio(
            "policy", list(controls.POLICIES), key="fleet_policy",
            index=list(controls.POLICIES).index(first.get("policy") or "prefill_first"),
            format_func=lambda p: controls.POLICY_LABELS.get(p, p), horizontal=False,
            disabled=off,
        )  # fmt: skip
        admission = None
        if any("admission" in cfg for cfg in configs):
            options = ["reserve", "optimistic"]
            admission = c[3].radio(
                "admission", options, key="fleet_admission",
                index=options.index(first.get("admission") or "reserve"), disabled=off,
            )  # fmt: skip
        sent = c[4].form_submit_button("Apply", type="primary", width="stretch", disabled=off)
        if off:
            st.caption(f"Budget, policy and admission: {disabled}")
    if sent and not off:
        command = controls.set_config(max_extend_tokens=int(budget), policy=str(policy))
        if admission is not None:
            command["admission"] = admission
        for line in apply_config(links, choice, command):
            st.caption(line)


def prompt_form(links: Sequence[Any], spec: FleetSpec, disabled: str | None = None) -> None:
    """Prompts go through the gateway when there is one (it routes them), else round-robin.
    `disabled`: why no prompt can be sent (a replay)."""
    off = disabled is not None
    with st.form("fleet-prompt", border=True):
        text = st.text_area("Prompt", key="fleet_prompt", height=70, disabled=off)
        c = st.columns([1, 1, 2])
        max_tokens = c[0].number_input(
            "max_tokens", min_value=1, value=64, key="fleet_max", disabled=off
        )
        copies = c[1].number_input("copies", min_value=1, max_value=controls.MAX_COPIES,
                                   value=1, key="fleet_copies", disabled=off)  # fmt: skip
        where = f"through the gateway {spec.gateway}" if spec.gateway else "round-robin"
        sent = c[2].form_submit_button(f"Submit ({where})", type="primary", disabled=off)
        if off:
            st.caption(f"Prompts: {disabled}")
    if not sent or off:
        return
    try:
        command = controls.submit(text or "", int(max_tokens), chat=True)
    except ValueError as exc:
        st.error(str(exc))
        return
    if spec.gateway:
        engine = next((e for link in links if (e := link.store.snapshot(last_steps=0).engine)), {})
        for _ in range(int(copies)):
            req = external.openai_request(
                spec.gateway.rstrip("/") + "/v1", str(command["prompt"]), int(max_tokens),
                0.0, True, engine.get("model"),
            )  # fmt: skip
            external.OpenAISubmit(req).start()
        st.caption(f"sent {int(copies)} prompt(s) to the gateway; it picks the replica")
        return
    for k in range(int(copies)):
        link = links[k % len(links)]
        try:
            link.send(dict(command))
        except (NotConnected, RuntimeError) as exc:
            st.error(f"{link.url}: {exc}")


def replica_charts(urls: tuple[str, ...], i: int) -> None:
    """One replica's live charts, on the fleet's clock (time on the x axis)."""
    links = fleet_links(urls)
    shifted = _shifted(urls)
    offsets = clock_offsets([link.store.snapshot(last_steps=0).engine for link in links])
    shifted[i].offset = offsets[i]
    opts = ViewOptions(window=WINDOW_STEPS, xmode="time")
    _live_charts(shifted[i], f"fleet-charts-{i}", opts, captions,
                 hidden=not links[i].status().ever_connected)  # fmt: skip


def render(spec: FleetSpec | None, problem: str | None = None) -> None:
    """The whole fleet page, or why the fleet it was given cannot be shown."""
    if spec is None:
        st.error(problem or "No fleet.")
        return
    links = fleet_links(spec.urls)
    rerun.await_hello(list(links))  # so this run draws the controls at the engines' values
    st.markdown(f"## :material/hub: stepscope: a fleet of {len(links)} engines")
    gateway = f" behind the gateway {spec.gateway}" if spec.gateway else ""
    st.caption(
        f"Replicas from {spec.source}{gateway}. Each replica's batches, chunk lanes, KV and "
        "waiting queue below, on one clock (seconds since the first engine started)."
    )
    known = all(link.store.snapshot(last_steps=0).config for link in links)
    st.fragment(live_summary, run_every=REFRESH_S)(links, known)
    controls_form(links)
    prompt_form(links, spec)
    for i, link in enumerate(links):
        st.markdown(f"#### {replica_name(i)} · `{link.url}`")
        st.fragment(replica_charts, run_every=LIVE_EVERY_S)(spec.urls, i)
