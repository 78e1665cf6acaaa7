"""The server's engine loop against a scripted fake engine: order, idling, calls, failures."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from engine.server import EngineLoop


class FakeLLM:
    """Each step emits its scripted events through the hook; None steps are idle."""

    def __init__(self, script: list[list[str] | None]) -> None:
        self.script = script
        self.hooks: list[Callable[[Any], None]] = []
        self.steps_run = 0

    def add_event_hook(self, fn: Callable[[Any], None]) -> None:
        self.hooks.append(fn)

    in_flight = False

    def has_work(self) -> bool:
        return bool(self.script)

    def step(self) -> str | None:
        if not self.script:
            return None
        events = self.script.pop(0)
        if events is None:
            return None
        if events == ["boom"]:
            raise RuntimeError("engine failure")
        for ev in events:
            for fn in self.hooks:
                fn(ev)
        self.steps_run += 1
        return f"record {self.steps_run}"


def run_in_thread(loop: EngineLoop) -> threading.Thread:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return thread


def test_every_event_is_published_in_order_and_flushed_when_idle() -> None:
    script: list[list[str] | None] = [[f"s{k}", f"t{k}"] for k in range(50)]
    llm = FakeLLM(script)
    batches: list[list[str]] = []
    published = threading.Event()

    def publish(batch: list[str]) -> None:
        batches.append(batch)
        if batch[-1] == "t49":
            published.set()

    loop = EngineLoop(llm, publish).attach()
    thread = run_in_thread(loop)
    assert published.wait(10), "the last events were not handed over once the engine idled"
    loop.stop()
    thread.join(10)
    flat = [ev for batch in batches for ev in batch]
    assert flat == [e for k in range(50) for e in (f"s{k}", f"t{k}")]
    assert loop.steps == 50 and not thread.is_alive()


def test_calls_run_between_steps_after_earlier_events_are_handed_over() -> None:
    llm = FakeLLM([["a"], ["b"], ["c"]])
    seen: list[str] = []
    loop = EngineLoop(llm, seen.extend).attach()
    answers = []

    def command_arrives_during_step(ev: str) -> None:
        if ev == "b":
            answers.append(loop.call(lambda: list(seen)))

    llm.add_event_hook(command_arrives_during_step)
    thread = run_in_thread(loop)
    # The call runs after step b and before step c, with b's events already handed over.
    assert answers_ready(answers) and answers[0].result(timeout=10) == ["a", "b"]
    loop.stop()
    thread.join(10)
    assert seen == ["a", "b", "c"]


def answers_ready(answers: list[Any]) -> bool:
    for _ in range(1000):
        if answers:
            return True
        threading.Event().wait(0.01)
    return False


def test_a_command_wakes_an_idle_loop() -> None:
    llm = FakeLLM([])
    loop = EngineLoop(llm, lambda batch: None).attach()
    thread = run_in_thread(loop)
    llm.script.append(["late"])
    loop.wake.set()
    assert loop.call(lambda: llm.steps_run).result(timeout=10) in (0, 1)
    loop.call(lambda: None).result(timeout=10)
    loop.stop()
    thread.join(10)
    assert llm.steps_run == 1


def test_an_engine_failure_is_counted_published_up_to_it_and_raised() -> None:
    llm = FakeLLM([["ok"], ["boom"], ["never"]])
    seen: list[str] = []
    loop = EngineLoop(llm, seen.extend).attach()
    pending = loop.call(lambda: "late")  # answered before the first step
    with pytest.raises(RuntimeError, match="engine failure"):
        loop.run()
    assert seen == ["ok"] and loop.errors == 1 and loop.steps == 1
    assert pending.result(timeout=1) == "late"
    after = loop.call(lambda: None)
    loop.stop()
    loop.run()  # stops at once; calls still queued are cancelled, not left hanging
    assert after.cancelled() or after.done()


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_gpu_engine_hands_over_every_step_even_when_it_never_waits(device: str) -> None:
    """A GPU engine's host may be the slower side (a 1-stream decode on an H200): the device
    never makes it wait, so no wait hook flushes; each step's events must still go out with
    that step, not ten steps at a time. A CPU engine batches fast steps."""
    import torch

    llm = FakeLLM([[f"s{k}"] for k in range(20)])
    llm.device = torch.device(device)  # type: ignore[attr-defined]
    batches: list[list[str]] = []
    loop = EngineLoop(llm, batches.append).attach()
    for _ in range(20):
        loop.run_once()
    loop.flush()
    assert [ev for b in batches for ev in b] == [f"s{k}" for k in range(20)]
    if device == "cuda":
        assert batches == [[f"s{k}"] for k in range(20)]
    else:  # 20 fake steps take far less than FLUSH_INTERVAL_S
        assert len(batches) < 20
