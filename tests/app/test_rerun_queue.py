"""A full run's messages reach the browser whole when a fragment run starts before they left
(app/rerun.py, `keep_full_runs_whole`): without the guard, Streamlit's queue dropped the full
run's fragment deltas but kept its "finished successfully", and the browser removed the
fragments' places, so the next fragment run wrote into a place that was gone."""

from __future__ import annotations

from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from streamlit.runtime.forward_msg_queue import ForwardMsgQueue

from app import rerun

FINISHED = ForwardMsg.ScriptFinishedStatus


def _delta(path: list[int], body: str, fragment: str = "") -> ForwardMsg:
    msg = ForwardMsg()
    msg.metadata.delta_path[:] = path
    msg.delta.new_element.markdown.body = body
    if fragment:
        msg.delta.fragment_id = fragment
    return msg


def _finished(status: int) -> ForwardMsg:
    msg = ForwardMsg()
    msg.script_finished = status  # type: ignore[assignment]
    return msg


def _run(status: int) -> ForwardMsgQueue:
    """A run's messages, unsent: a plain element, a fragment's element, the run's end."""
    queue = ForwardMsgQueue()
    queue.enqueue(_delta([0, 5], "the status line"))
    queue.enqueue(_delta([0, 8], "the detail tabs", fragment="details"))
    queue.enqueue(_finished(status))
    return queue


def _bodies(queue: ForwardMsgQueue) -> list[str]:
    return [m.delta.new_element.markdown.body for m in queue.flush() if m.HasField("delta")]


def test_a_fragment_run_keeps_the_finished_full_run_it_follows() -> None:
    rerun.keep_full_runs_whole()
    queue = _run(FINISHED.FINISHED_SUCCESSFULLY)
    queue.clear(retain_lifecycle_msgs=True, fragment_ids_this_run=["details"])
    # the fragment run's own delta for the same place follows, not merged into the old one
    queue.enqueue(_delta([0, 8], "the detail tabs, redrawn", fragment="details"))
    assert _bodies(queue) == ["the status line", "the detail tabs", "the detail tabs, redrawn"]


def test_an_interrupted_run_is_still_dropped_as_streamlit_does() -> None:
    rerun.keep_full_runs_whole()
    queue = _run(FINISHED.FINISHED_EARLY_FOR_RERUN)  # a fragment run's end, or a cut run's
    queue.clear(retain_lifecycle_msgs=True, fragment_ids_this_run=["details"])
    assert _bodies(queue) == ["the status line"]  # only the rerun fragment's delta goes
    full = _run(FINISHED.FINISHED_SUCCESSFULLY)
    full.clear(retain_lifecycle_msgs=True)  # a new full run: all of the old one's deltas go
    assert _bodies(full) == []
