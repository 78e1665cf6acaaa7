"""The named delay in the live charts' payload, and what the timeline's lanes say on hover.

The chapter's case on the protocol peer's simulated engine (its step times are a formula, so
every figure is known): four chats decode, then a 300-token prompt (request 4) is chunked 64
tokens a step under prefill-first. Each chat's stall is described once, in the batch its token
came in, as instrumentation's `GapDelay.describe()` says it, naming the long prompt's request
and its chunks; the timeline's stall segment shows it on hover (app/live/static, run in Node);
a grey waiting stretch says each step's waiting reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app.live.component import style
from app.live.encode import MAX_LANES
from app.live.feed import LiveFeed, ViewOptions
from app.state import EventStore
from instrumentation.blame import request_wait
from tests.app.app_peer import SimEngine

Message = dict[str, Any]
STATIC = Path(__file__).resolve().parents[2] / "app" / "live" / "static"
OPTS = ViewOptions(window=500, xmode="step")
# a chat's stall: the five chunk steps of request 4 (4 x 148 ms + 108 ms), then its decode step
STALL = "740 ms: 700 ms request 4's prompt [0:300] in steps 6–10, 40 ms own decode in step 11"


def hello(sim: SimEngine) -> Message:
    return {"type": "hello", "protocol": 1, "now": 0.0, "seq": -1,
            "engine": {"model": "sim", "page_size": 1, "num_pages": sim.num_pages,
                       "instance": "x"},
            "config": dict(sim.config), "history": {"steps": [], "requests": []}}  # fmt: skip


def chapter(policy: str = "prefill_first", chats: int = 4) -> list[Message]:
    """Chats (12-token prompts, 24 tokens each) decode for a few steps; then a 300-token prompt
    arrives and is chunked 64 tokens a step."""
    sim = SimEngine(max_extend_tokens=64, policy=policy)
    msgs = [hello(sim)]
    for _ in range(chats):
        msgs += sim.submit(12, 24)[1]
    for _ in range(6):
        msgs += sim.step()
    msgs += sim.submit(300, 4)[1]
    while sim.busy:
        msgs += sim.step()
    return msgs


def fed(msgs: list[Message]) -> EventStore:
    store = EventStore()
    for m in msgs:
        store.apply(m)
    return store


def test_a_chats_stall_names_the_long_prompt_and_its_chunks() -> None:
    store = fed(chapter())
    batch = LiveFeed().payload(store, None, OPTS)
    assert batch["stalls"] == [[uid, 6, 10, 0.74] for uid in range(4)]
    # the same text is sent once: the other rows name the row that says it
    assert batch["waits"] == [[0, 6, STALL], [1, 6, 0], [2, 6, 0], [3, 6, 0]]
    firsts = dict(batch["firsts"])
    assert firsts[4] == "700 ms: 700 ms own prompt [0:300] in steps 6–10"
    # a chat's first token: its share of the step that prefilled all four
    assert firsts[0].startswith("116 ms: 29 ms own prompt [0:12] in step 0, ")
    # the text is instrumentation's, for the wait the stall's token ended
    gap = request_wait(store._fold, 0, step=11)
    assert gap is not None and gap.stall and gap.describe() == STALL


def pulls(msgs: list[Message]) -> list[dict]:
    """The batches a browser pulls while the run is folded message by message: one after each
    step message (before its tokens: a pull can come between them), and one after its tokens."""
    store, feed = EventStore(), LiveFeed()
    have, out = None, []
    for m in msgs:
        if m["type"] == "step" and store.version:
            batch = feed.payload(store, have, OPTS)  # the previous step's tokens are folded
            have = batch["id"]
            out.append(batch)
        store.apply(m)
        if m["type"] == "step":
            batch = feed.payload(store, have, OPTS)  # its tokens are not
            have = batch["id"]
            out.append(batch)
    return out


def test_each_wait_is_described_once_in_the_batch_that_can_say_it() -> None:
    """Batch by batch, each stall's text comes once; a batch made between a step and its tokens
    has the stall but not yet its text, which comes with the next batch."""
    batches = pulls(chapter())
    said = [w for b in batches for w in b.get("waits", ())]
    assert said == [[0, 6, STALL], [1, 6, 0], [2, 6, 0], [3, 6, 0]]  # each once
    stalled = next(i for i, b in enumerate(batches) if b.get("stalls"))
    assert "waits" not in batches[stalled]  # the step is folded, its tokens not yet
    assert batches[stalled + 1]["waits"] == said
    # most batches carry no description at all: steady decoding costs nothing more
    assert sum("waits" in b or "firsts" in b for b in batches) <= 8 < len(batches) // 4


def test_a_stall_still_going_on_says_what_it_waited_for_so_far() -> None:
    """Said in a batch that starts a view: a new tab's, or a paused one's."""
    msgs = chapter()
    cut = next(i for i, m in enumerate(msgs) if m["type"] == "step" and m["step"] == 9)
    batch = LiveFeed().payload(fed(msgs[:cut]), None, OPTS)  # through step 8: three chunks
    assert [row[:3] for row in batch["ongoing"]] == [[uid, 6, 8] for uid in range(4)]
    assert {row[4] for row in batch["ongoing"]} == {
        "444 ms: 444 ms request 4's prompt [0:192] in steps 6–8"
    }
    # it changes every step: a live update after the first leaves it out (a paused view,
    # which starts afresh, has it)
    batches = pulls(msgs[:cut])
    assert all(len(row) == 4 for b in batches[2:] for row in b.get("ongoing", ()))
    paused = LiveFeed().payload(fed(msgs[:cut]), None, ViewOptions(500, "step", paused=True))
    assert [row[4] for row in paused["ongoing"]] == [row[4] for row in batch["ongoing"]]


def test_only_the_requests_with_a_lane_are_described() -> None:
    """The timeline draws lanes for the newest MAX_LANES requests: the oldest chat's stall is
    not described (no lane shows it), the others' are."""
    msgs = chapter(chats=MAX_LANES + 1)
    batch = LiveFeed().payload(fed(msgs), None, OPTS)
    order = list(dict.fromkeys(it["uid"] for m in msgs if m["type"] == "step" for it in m["items"]))
    with_lane = set(order[-MAX_LANES:])  # the newest by their first step, as the lanes
    described = {uid for uid, _, _ in batch["waits"]}
    stalled = {uid for uid, *_ in batch["stalls"]}
    assert 0 in stalled and 0 not in with_lane and 0 not in described
    assert described == stalled & with_lane and len(described) == MAX_LANES - 1


# ---- the lanes' hover, drawn by the browser's code (Node) ------------------------------------

LANES_JS = """
globalThis.window = globalThis;
for (const f of ["data.js", "timeline.js"]) require(process.argv[1] + "/" + f);
const S = window.stepscope, input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const rec = new S.Record();
rec.apply(input.batch, 1e9);
const tl = S.timelineFigure(rec, new S.Axis(rec, "step"), input.style, null, 1200, null);
const lanes = {};
for (const t of tl.data) if (t.yaxis === "y2") lanes[t.name] = t.y.map((y, k) => [y, t.customdata[k]]);
console.log(JSON.stringify(lanes));
"""


def lanes(batch: dict) -> dict[str, list[list[str]]]:
    """The timeline's lane segments by trace: [lane, hover text]."""
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed")
    batch = {k: v for k, v in batch.items() if k != "config"}
    done = subprocess.run(["node", "-e", LANES_JS, str(STATIC)], check=True, text=True,
                          input=json.dumps({"batch": batch, "style": style()}),
                          capture_output=True)  # fmt: skip
    return json.loads(done.stdout)


def test_hovering_a_chats_stall_shows_what_it_waited_for() -> None:
    drawn = lanes(LiveFeed().payload(fed(chapter()), None, OPTS))
    stalls = dict(drawn["stall (no token this step)"])
    assert stalls["req 0"] == (
        "stall: 740 ms without a token<br>it waited 740 ms:<br>"
        "· 700 ms request 4's prompt [0:300] in steps 6–10<br>· 40 ms own decode in step 11"
    )
    assert stalls["req 3"] == stalls["req 0"]  # sent as "the text of row 0"
    chunks = [text for lane, text in drawn["prompt chunk [start:end)"] if lane == "req 4"]
    assert chunks[-1] == (
        "step 10 · prefill [256:300) · 44 tokens<br>its first token waited 700 ms:<br>"
        "· 700 ms own prompt [0:300] in steps 6–10"
    )


def test_hovering_a_waiting_stretch_shows_each_steps_reason() -> None:
    """Budget 16, two 40-token prompts: request 1 waits while request 0 is chunked; the steps
    say the head of the queue waited for the budget, then for the pool."""
    sim = SimEngine(max_extend_tokens=16)
    msgs = [hello(sim), *sim.submit(40, 2)[1], *sim.submit(40, 2)[1]]
    while sim.busy:
        msgs += sim.step()
    reasons = {0: "budget", 1: "kv"}
    for m in msgs:
        if m["type"] == "step":
            m["queue"]["waiting_reason"] = reasons.get(m["step"])
    waiting = dict(lanes(LiveFeed().payload(fed(msgs), None, OPTS))["waiting"])
    assert waiting["req 1"] == (
        "waiting for admission<br>the head of the queue waited for:<br>· step 0: budget<br>"
        "· step 1: kv<br>(admission is FIFO: a request behind the head waits for the head's "
        "reason)"
    )
