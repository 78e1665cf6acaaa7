"""PiecewiseGraphs: CUDA graphs of the prefill and mixed forward, cut around attention (vLLM's
piecewise graphs), one set per bucketed token count.

A prefill or mixed step changes shape every step, so the decode graphs (engine.cuda_graph) cannot
serve it, and eagerly it is some 280 launches from Python: on the H200 that host work took 15 ms
for a 512-token chunk whose kernels take under 4 ms, so the host set the step's time.
Everything between two attention calls (the projections, norms, activation, RoPE and the K/V
store) depends on the token count alone, so it is captured once per bucket; only attention,
whose plan depends on the requests' lengths, runs eagerly, once per layer, over the real tokens.
A step of T tokens replays the graphs of the next bucket up: L + 1 replays and L attention calls
instead of ~10 L launches.

The padding tokens (T to the bucket) embed token 0 at position 0 and write their K and V into
the spare page the allocator never hands out, as the decode graphs' padding rows do; attention
never reads them, and every projection works row by row, so they change no real token's result.

Buffers: one int64 input buffer (token ids, positions, KV slots), the queries each piece leaves
for attention and the attention output the next piece reads are shared by every bucket (one runs
at a time); the graphs share one memory pool, captured largest first.
"""

from __future__ import annotations

import bisect
import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.models.llama import CausalLM

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Captured token counts: powers of two and halfway points to 128, then every 64 to 1,024,
    then every 256. A step pads fewer than 64 tokens from 128 to 1,024 tokens (under half of a
    129-token step) and fewer than 256 beyond (under a quarter)."""
    sizes = [8, 16, 32, 48, 64, 96, 128]
    sizes += range(192, 1025, 64)
    sizes += range(1280, max_tokens + 1, 256)
    out = sorted({s for s in sizes if s < max_tokens} | {max_tokens})
    return out


class CutAtAttention(AttentionBackend):
    """The backend the model sees while a bucket is captured: it stores the step's K and V (when
    the layer did not), copies the queries into the shared buffer, calls `cut(layer)` (which ends
    the piece being captured and starts the next) and hands the model the attention output
    buffer, which the eager attention call fills between the two pieces at replay."""

    name = "piecewise"

    def __init__(
        self,
        real: AttentionBackend,
        queries: torch.Tensor,
        attn_out: torch.Tensor,
        slots: Callable[[int], torch.Tensor],
    ) -> None:
        super().__init__(real.pool, real.num_heads, real.num_kv_heads, real.head_dim)
        self.queries, self.attn_out, self.slots = queries, attn_out, slots
        self.tokens = 0
        self.cut: Callable[[int], None] | None = None  # None: warm-up, no capture running

    def prepare(self, layout: BatchLayout) -> Any:
        raise NotImplementedError("the piecewise capture backend is not planned")

    def new_token_slots(self, meta: Any) -> torch.Tensor:
        return self.slots(self.tokens)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: int,
        meta: Any,
    ) -> torch.Tensor:
        n = self.tokens
        if k is not None and v is not None:
            self.pool.store(layer, self.slots(n), k, v)
        self.queries[:n].copy_(q.reshape(n, self.num_heads, self.head_dim))
        if self.cut is not None:
            self.cut(layer)
        return self.attn_out[:n]

    def attend(self, q: torch.Tensor, layer: int, meta: Any) -> torch.Tensor:
        raise NotImplementedError("the piecewise capture backend does not attend")


def runs_between_pieces(backend: AttentionBackend) -> bool:
    """Whether `backend` can attend eagerly between graph pieces (`attend_into`)."""
    return callable(getattr(backend, "attend_into", None))


class PiecewiseGraphs:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        pad_slot: int,
        max_tokens: int,
        device: torch.device,
    ) -> None:
        attend_into = getattr(backend, "attend_into", None)
        if not runs_between_pieces(backend):
            raise TypeError(f"the {backend.name} attention backend cannot run between pieces")
        self.model, self.backend, self.pad_slot = model, backend, pad_slot
        self.attend_into: Callable[..., None] = attend_into
        self.sizes = token_buckets(max_tokens)
        self.max_tokens = self.sizes[-1]
        m = max_tokens
        cfg = model.config
        dtype = model.lm_head.weight.dtype
        # token ids at [0, g), positions at [g, 2g), KV slots at [2g, 3g) for a bucket of g
        self.io = torch.zeros(3 * m, dtype=torch.int64, device=device)
        self.queries = torch.zeros(m, model.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros_like(self.queries)
        self.num_layers = cfg.num_layers
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self._capture(device)

    def slots(self, g: int) -> torch.Tensor:
        return self.io[2 * g : 3 * g]

    def _views(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.io[:g], self.io[g : 2 * g]

    def fits(self, tokens: int) -> bool:
        return tokens <= self.max_tokens

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        cut = CutAtAttention(self.backend, self.queries, self.attn_out, self.slots)
        pool = torch.cuda.graph_pool_handle()
        # As torch.cuda.graph does around its one capture: a finalizer run by the collector
        # mid-capture (an earlier engine's tensors, events) can make a call that invalidates it
        # (seen once in a GPU test run: "operation failed due to a previous error during
        # capture" at layer 1), so collect first and keep the collector off until the end.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._capture_all(cut, pool, device)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize(device)
        log.info("captured piecewise prefill graphs for %d token counts up to %d",
                 len(self.sizes), self.max_tokens)  # fmt: skip

    def _capture_all(self, cut: CutAtAttention, pool: Any, device: torch.device) -> None:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for g in reversed(self.sizes):  # largest first: the rest fit in its memory
                ids, pos = self._views(g)
                ids.zero_()
                pos.zero_()
                self.slots(g).fill_(self.pad_slot)
                cut.tokens, cut.cut = g, None
                # lazy allocations and compilations happen outside the capture
                self.model(ids, pos, cut, None)
                graphs = [torch.cuda.CUDAGraph()]

                def next_piece(layer: int, graphs: list[torch.cuda.CUDAGraph] = graphs) -> None:
                    graphs[-1].capture_end()
                    graphs.append(torch.cuda.CUDAGraph())
                    graphs[-1].capture_begin(pool=pool, capture_error_mode="thread_local")

                cut.cut = next_piece
                graphs[0].capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    hidden = self.model(ids, pos, cut, None)
                finally:
                    graphs[-1].capture_end()
                if len(graphs) != self.num_layers + 1:
                    raise RuntimeError(
                        f"captured {len(graphs)} pieces for {self.num_layers} layers"
                    )
                self.pieces[g], self.hidden[g] = graphs, hidden
        torch.cuda.current_stream(device).wait_stream(stream)

    def bucket(self, tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        prepare: Callable[[torch.Tensor], Any],
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of one step's T tokens (token ids[i] at positions[i], its K
        and V to slots[i]). `prepare(out_loc)` plans the step's attention (the real tokens' KV
        slots, on the device) and returns its metadata; `fill` may then overwrite token ids in
        the input buffer on the device (ids the host does not know yet)."""
        n = len(ids)
        g = self.bucket(n)
        pad = g - n
        host = torch.tensor(
            ids + [0] * pad + positions + [0] * pad + slots + [self.pad_slot] * pad,
            dtype=torch.int64,
        )
        self.io[: 3 * g].copy_(host, non_blocking=True)  # a blocking copy waits for the device
        if fill is not None:
            fill(self.io)
        meta = prepare(self.slots(g)[:n])
        pieces = self.pieces[g]
        q, out = self.queries[:n], self.attn_out[:n]
        for layer in range(self.num_layers):
            pieces[layer].replay()
            self.attend_into(q, layer, meta, out)
        pieces[-1].replay()
        return self.hidden[g][:n]
