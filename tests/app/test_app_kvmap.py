"""The KV page map: the engine's `kv_map` reading (run-length encoded owners) and the app's side.

The engine half runs the tiny random Llama; the app half needs no engine.
"""

from __future__ import annotations

import random

from app.kvmap import PageMapStore, page_counts
from engine import LLM, SamplingParams
from instrumentation.commands import KVMap, parse_command


def _pages(kv_map: dict, state: str, uid: int | None = None) -> int:
    code = kv_map["states"].index(state)
    return sum(n for n, s, u, _ in kv_map["runs"] if s == code and (uid is None or u == uid))


def test_page_map_names_owners_shared_prefix_pages_and_frees_an_aborted_request(
    tiny_llama_dir,
) -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(3, 49152) for _ in range(64)]
    first = prefix + [rng.randrange(3, 49152) for _ in range(8)]
    llm = LLM(str(tiny_llama_dir), max_extend_tokens=16, progress=False, num_pages=600)
    llm.generate([first], SamplingParams(max_tokens=2, ignore_eos=True))  # the cache keeps it
    idle = llm.kv_map()
    assert sum(n for n, *_ in idle["runs"]) == idle["num_pages"] == 600
    assert _pages(idle, "used") == _pages(idle, "shared") == 0
    assert _pages(idle, "cached") == len(first) + 1  # every computed token, page size 1

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    sharer = llm.submit(prefix + [rng.randrange(3, 49152) for _ in range(5)], params)
    other = llm.submit([rng.randrange(3, 49152) for _ in range(50)], params)
    for _ in range(6):  # both admitted, the second one part-way through its chunks
        llm.step()
    busy = llm.kv_map()
    assert _pages(busy, "shared", sharer) == 64  # the radix hit: the shared prefix
    assert _pages(busy, "used", sharer) > 0  # its own suffix and decodes
    assert _pages(busy, "used", other) > 0
    assert busy["reserved_pages"] > 0 and busy["reserved_tokens"] > 0
    assert sum(n for n, *_ in busy["runs"]) == 600
    assert all(n >= 1 for n, *_ in busy["runs"])
    # a run never spans two owners or states: neighbours differ
    for a, b in zip(busy["runs"], busy["runs"][1:], strict=False):
        assert a[1:] != b[1:]

    held = _pages(busy, "used", other)
    llm.abort(other)
    llm.step()
    after = llm.kv_map()
    assert _pages(after, "used", other) == _pages(after, "shared", other) == 0
    assert _pages(after, "free") + _pages(after, "cached") >= _pages(busy, "free") + held - 2
    llm.check_integrity()


def test_kv_map_is_a_command() -> None:
    cmd = parse_command('{"type": "kv_map", "id": "m1"}', vocab_size=10, policies=("mixed",))
    assert cmd == KVMap("m1")


def test_the_app_store_keeps_the_newest_page_map_and_counts_it() -> None:
    store = PageMapStore()
    assert store.page_map() is None
    assert store.apply({"type": "kv_map", "id": "a", "runs": [[3, 2, 7, 1]]}) is False
    reply = {
        "type": "kv_map",
        "id": "b",
        "num_pages": 10,
        "runs": [[4, 3, 1, 2], [2, 2, 1, 1], [1, 1, -1, 0], [3, 0, -1, 0]],
    }
    store.apply(reply)
    assert store.wait_page_map("b", 0.1) == reply
    assert page_counts(reply["runs"]) == {
        "free": 3,
        "cached": 1,
        "used": 2,
        "shared": 4,
        "owners": {1: 6},
    }
    # ordinary messages still reach the store proper
    store.apply({"type": "config", "id": "c", "t": 1.0, "max_extend_tokens": 8, "policy": "mixed"})
    assert store.reply("c") is not None
