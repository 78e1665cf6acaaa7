"""PrefillAdder: fills one step's prompt work within the token budget `max_extend_tokens`.

Under `reserve` admission a request is promised all the pages it will ever need (the rest of its
prompt plus its outputs), so a later chunk or decode never waits for room. Under `optimistic`
only the prompt's pages are promised (a chunk still never waits), and the outputs are an
estimate (engine.scheduler.admission). A prompt that does not fit in the budget left becomes a
`ChunkedReq` for this step and continues first on the next. A retracted request is admitted
again like any other, with its generated tokens as part of the prompt to (re)compute.

The adder also remembers why the first request it could not admit had to wait
(`waiting_reason`): the step's budget, the running cap, the pages, or pages promised to others.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kvcache.manager import KVManager, pages_for
from engine.kvcache.prefix import CacheHandle
from engine.request import ChunkedReq, PendingReq, Req
from instrumentation.protocol import WaitReason

# pages the running optimistic requests are estimated to need, given a new request's outputs
Holder = Callable[[int], int]


class PrefillAdder:
    def __init__(
        self,
        token_budget: int,
        kv: KVManager,
        now: float,
        *,
        optimistic: bool = False,
        hold: Holder | None = None,
        admit_seq: Callable[[], int] | None = None,
    ) -> None:
        self.token_budget = token_budget
        self.kv = kv
        self.now = now
        self.optimistic = optimistic
        self.hold: Holder = hold or (lambda _outputs: 0)
        self._admit_seq = admit_seq or (lambda: 0)
        self.frozen = False  # set in a step that retracted: no new admissions in it
        self.admitted: list[Req] = []  # requests admitted this step (for `admitted` events)
        self.waiting_reason: WaitReason | None = None

    def try_add_one(self, pending: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            self.waiting_reason = "budget"
            return None
        if chunked := pending.chunked_req:
            # chunking is under way: the row, the pages and the cache lock are already held
            return self._add_one_req(
                pending, chunked.cache_handle, chunked.table_idx, chunked.cached_len
            )
        if self.frozen:  # decodes were short of pages this very step
            self.waiting_reason = "kv"
            return None
        state = pending.state
        # a retracted request is readmitted only once its last token has been read
        assert state.launched_tokens == len(state.output_ids), "readmitted with a token in flight"
        ids = state.prompt_ids + state.output_ids if state.output_ids else state.prompt_ids
        outputs = state.outputs_left
        if self.optimistic:
            promise, hold = len(ids), self.hold(outputs)
        else:
            promise, hold = len(ids) + outputs, self.hold(0)
        # prompt logprobs need every prompt position computed: no prefix-cache hit until done
        cached = state.params.prompt_logprobs is None or state.prompt_logprobs_done
        resource = self.kv.try_admit(ids, promise, pages_for(hold, self.kv.page_size), cached)
        if isinstance(resource, str):
            self.waiting_reason = resource
            return None
        handle, row = resource
        if state.t_admitted is None:  # the first admission: a readmission keeps its figures
            state.t_admitted, state.cached_len = self.now, handle.cached_len
        state.matched_len = handle.cached_len
        state.outputs_promised = not self.optimistic
        state.admit_seq = self._admit_seq()
        req = self._add_one_req(pending, handle, row, handle.cached_len)
        self.admitted.append(req)
        return req

    def _add_one_req(
        self, pending: PendingReq, handle: CacheHandle, table_idx: int, cached_len: int
    ) -> Req:
        remain_len = pending.input_len - cached_len
        chunk_size = min(self.token_budget, remain_len)
        self.token_budget -= chunk_size
        cls = ChunkedReq if chunk_size < remain_len else Req
        return cls(
            state=pending.state,
            table_idx=table_idx,
            cache_handle=handle,
            cached_len=cached_len,
            device_len=cached_len + chunk_size,
        )
