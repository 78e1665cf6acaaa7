"""DecodeGraphs: CUDA graphs of the whole decode forward (embedding to logits), one per bucketed
batch size, captured at start-up and replayed for every pure decode step.

Decode is launch-bound: one step is hundreds of small kernels, and launching them one by one from
Python costs more than running them. A graph launches them all at once. A batch is padded to the
next captured size; the padding rows decode token 0 at position 0 and write their K and V into a
spare page that the allocator never hands out, so they touch no request's cache. Mixed and
prefill steps, whose shapes change every step, replay the piecewise graphs of
engine.piecewise_graph instead.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from engine.attention.base import AttentionBackend
from engine.kvcache.table import PageTable
from engine.models.llama import CausalLM

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
LARGE_STEP = 32  # beyond 64 rows, a graph every 32: padding then wastes at most a third


def buckets(max_batch: int) -> list[int]:
    """The captured batch sizes: fine-grained where a padded row is a large share of the step."""
    sizes = [b for b in SMALL_BUCKETS if b < max_batch]
    sizes += range(SMALL_BUCKETS[-1] + LARGE_STEP, max_batch, LARGE_STEP)
    return [*sizes, max_batch]


@runtime_checkable
class GraphBackend(Protocol):
    """An attention backend whose decode step can be captured (FlashInferAttention)."""

    def graph_meta(self, batch_size: int, out_loc: torch.Tensor, max_pages: int) -> Any: ...

    def plan_graph(
        self, meta: Any, table: PageTable, rows: list[int], lengths: list[int], pad_page: int
    ) -> None: ...


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        table: PageTable,
        pad_page: int,
        page_size: int,
        max_batch: int,
        device: torch.device,
    ) -> None:
        if not isinstance(backend, GraphBackend):
            raise TypeError(f"the {backend.name} attention backend cannot be captured")
        self.model, self.backend, self.table = model, backend, table
        self.pad_page, self.page_size = pad_page, page_size
        self.sizes = buckets(max_batch)
        self.max_batch = self.sizes[-1]
        # one flat int64 buffer, one host-to-device copy a step: a graph of size g reads its
        # token ids at [0, g), positions at [g, 2g) and KV slots at [2g, 3g)
        self.io = torch.zeros(3 * self.max_batch, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metas: dict[int, Any] = {}
        self.logits: dict[int, torch.Tensor | None] = {}  # None on tensor-parallel ranks > 0
        self._capture(device)

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        pages_per_row = self.table.slots.shape[1] // self.page_size + 1
        pool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the memory the largest already holds
        for g in reversed(self.sizes):
            ids, pos, loc = self._views(g)
            ids.zero_()
            pos.zero_()
            loc.fill_(self.pad_page * self.page_size)
            meta = self.backend.graph_meta(g, loc, g * pages_per_row)
            self.backend.plan_graph(meta, self.table, [], [], self.pad_page)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up: lazy allocations happen outside capture
                for _ in range(2):
                    self._forward(ids, pos, meta)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # under tensor parallelism NCCL's watchdog thread queries its events while this
            # thread captures: only this thread's calls may break the capture
            mode = "thread_local" if self.model.tp.size > 1 else "global"
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                self.logits[g] = self._forward(ids, pos, meta)
            self.graphs[g], self.metas[g] = graph, meta
        torch.cuda.synchronize(device)
        log.info("captured %d decode CUDA graphs, batch sizes %s", len(self.sizes), self.sizes)

    def _views(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.io[:g], self.io[g : 2 * g], self.io[2 * g : 3 * g]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor | None:
        hidden = self.model(ids, pos, self.backend, meta)
        logits = self.model.logits(hidden)  # gathered on rank 0 under tensor parallelism
        return None if logits is None else logits.float()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def replay(
        self,
        rows: list[int],
        lengths: list[int],
        ids: list[int],
        slots: list[int],
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Logits [B, vocab] of one decode step (None on tensor-parallel ranks > 0, which
        replay the same graph for its collectives): request i adds token ids[i] at position
        lengths[i] - 1, whose KV goes to slot slots[i]. `fill` may then overwrite token ids
        in the input buffer on the device (ids the host does not know yet)."""
        n = len(rows)
        g = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = g - n
        host = torch.tensor(
            ids
            + [0] * pad
            + [length - 1 for length in lengths]
            + [0] * pad
            + slots
            + [self.pad_page * self.page_size] * pad,
            dtype=torch.int64,
        )
        self.io[: 3 * g].copy_(host, non_blocking=True)  # a blocking copy waits for the device
        if fill is not None:
            fill(self.io)
        self.backend.plan_graph(self.metas[g], self.table, rows, lengths, self.pad_page)
        self.graphs[g].replay()
        logits = self.logits[g]
        return None if logits is None else logits[:n]
