"""PrefillAdder: fills one step's prompt work within the token budget `max_extend_tokens`.

A request is admitted with all the pages it will ever need promised (the rest of its prompt
plus `max_tokens`), so a later chunk never waits for room. A prompt that does not fit in the
budget left becomes a `ChunkedReq` for this step and continues first on the next.
"""

from __future__ import annotations

from engine.kvcache.manager import KVManager
from engine.kvcache.prefix import CacheHandle
from engine.request import ChunkedReq, PendingReq, Req


class PrefillAdder:
    def __init__(self, token_budget: int, kv: KVManager, now: float) -> None:
        self.token_budget = token_budget
        self.kv = kv
        self.now = now
        self.admitted: list[Req] = []  # requests admitted this step (for `admitted` events)

    def try_add_one(self, pending: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            return None
        if chunked := pending.chunked_req:
            # chunking is under way: the row, the pages and the cache lock are already held
            return self._add_one_req(
                pending, chunked.cache_handle, chunked.table_idx, chunked.cached_len
            )
        state = pending.state
        # prompt logprobs need every prompt position computed: no prefix-cache hit
        cached = state.params.prompt_logprobs is None
        resource = self.kv.try_admit(state.prompt_ids, state.params.max_tokens, cached)
        if resource is None:
            return None
        handle, row = resource
        state.t_admitted, state.cached_len = self.now, handle.cached_len
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
