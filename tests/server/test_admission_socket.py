"""Admission over the socket: switching `admission` mid-run applies
from the next step and is broadcast as `config`; a `retracted` event is followed by the
request's recompute and then its remaining tokens; `/metrics` counts the preemptions."""

from __future__ import annotations

import random
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_openai_api import ApiServer, stop
from tests.server.test_server_support import Msg

N_REQ = 12


def _ids(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 9))]


def _metrics(http_url: str) -> dict[str, dict[tuple, float]]:
    with urllib.request.urlopen(http_url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def test_admission_switch_retraction_and_metrics(tiny_llama_dir: Path) -> None:
    srv = ApiServer(
        tiny_llama_dir, "--num-pages", "64", "--max-seq-len", "64", "--max-running-req", "16",
        "--schedule-conservativeness", "0.3", "--new-token-ratio-decay-steps", "3",
        "--max-extend-tokens", "7", "--policy", "mixed",
    )  # fmt: skip
    try:
        c, other = srv.client(), srv.client()
        assert c.hello["config"]["admission"] == "reserve"
        rng = random.Random(5)
        uids = []
        for i in range(N_REQ):
            reply = c.reply({"type": "submit", "id": f"a{i}", "input_ids": _ids(rng),
                             "max_tokens": rng.randrange(24, 41), "ignore_eos": True})  # fmt: skip
            assert reply["type"] == "accepted", reply
            uids.append(reply["uid"])
        # some steps under reserve, then the switch, while requests are running
        c.until(lambda m: m["type"] == "token")
        reply = c.reply({"type": "set_config", "id": "c1", "admission": "optimistic"})
        assert reply["type"] == "config" and reply["id"] == "c1"
        assert reply["admission"] == "optimistic" and reply["policy"] == "mixed"
        seen = other.until(lambda m: m["type"] == "config")  # a broadcast: every client sees it
        assert seen["admission"] == "optimistic" and seen["seq"] == reply["seq"]
        ended: set[int] = set()
        c.until(
            lambda m: m["type"] == "request" and m["event"] == "finished"
            and (ended.add(m["uid"]) or len(ended) == N_REQ)
        )  # fmt: skip
        steps = [m for m in c.seen if m["type"] == "step"]
        before = [s for s in steps if s["seq"] < reply["seq"]]
        after = [s for s in steps if s["seq"] > reply["seq"]]
        assert before and after
        # a step scheduled before the change keeps the old mode; every one after has the new
        assert all(s["admission"] == "reserve" for s in before if s["t0"] < reply["t"])
        assert all(s["admission"] == "optimistic" for s in after if s["t0"] > reply["t"])
        assert not any(s.get("retracted") for s in before)
        _check_retractions(c.seen)
        metrics = _metrics(srv.http_url)
        retracted = [m for m in c.seen if m["type"] == "request" and m["event"] == "retracted"]
        assert len(retracted) >= 3
        assert metrics["stepscope:num_preemptions_total"][()] == len(retracted)
        recomputed = sum(
            i["end"] - i["start"] for s in steps for i in s["items"] if i["kind"] == "recompute"
        )
        assert metrics["stepscope:prompt_tokens_recomputed_total"][()] == recomputed > 0
        by_reason = metrics["stepscope:num_requests_waiting_by_reason"]
        assert set(by_reason) == {(("reason", r),) for r in ("budget", "kv", "max_running",
                                                              "reserved")}  # fmt: skip
        assert {s["queue"]["waiting_reason"] for s in steps} >= {"kv", "budget"}
        stats = c.stats()
        assert stats["integrity"] == "ok"
        c.close()
        other.close()
    finally:
        stop(srv)


def _check_retractions(seen: list[Msg]) -> None:
    """For each `retracted` event: the request's next items are `recompute` pieces covering
    [readmission's cached_len, recompute_len), the last one sampling, before any token of it;
    then its remaining tokens come, one per step."""
    for k, ev in enumerate(seen):
        if not (ev["type"] == "request" and ev["event"] == "retracted"):
            continue
        uid = ev["uid"]
        later = [m for m in seen[k + 1 :] if m.get("uid") == uid or m["type"] == "step"]
        readmit = next(m for m in later if m["type"] == "request")
        assert readmit["event"] == "admitted" and readmit["recompute"] is True
        pieces: list[Msg] = []
        token_before = False
        for m in later:
            if m["type"] == "token" and (not pieces or not pieces[-1].get("sample")):
                token_before = True
            if m["type"] == "step":
                mine = [i for i in m["items"] if i["uid"] == uid]
                if mine and mine[0]["kind"] != "recompute":
                    assert pieces, "no recompute after a retraction"
                    break
                pieces += mine
                if pieces and pieces[-1].get("sample"):
                    # the recompute ended here; a request retracted again at once (the most
                    # recently admitted goes first) recomputes anew, under its next event
                    break
        assert not token_before, "a token came before the recompute ended"
        assert pieces[0]["start"] == readmit["cached_len"]
        assert pieces[-1]["end"] == ev["recompute_len"] and pieces[-1].get("sample")
        assert all(a["end"] == b["start"] for a, b in zip(pieces, pieces[1:], strict=False))
