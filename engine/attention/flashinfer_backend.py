"""FlashInferAttention: paged attention on CUDA through FlashInfer's prefill and decode wrappers.

Each step is planned once from CPU index arrays built off the page table: the prefill wrapper
(causal, queries aligned to the end of each request's KV, so a chunk after a cached prefix is
planned as a fresh prompt is) serves prefill and mixed steps; the decode wrapper serves steps
where every request adds one token. For CUDA graphs the backend also hands out one decode
wrapper per captured batch size, bound to fixed index buffers that `plan_graph` refills; where
the head shape allows, a graph decodes instead through the one-launch split-KV kernel of
engine/kernels/decode.py (FlashInfer's decode is a kernel and a merge a layer), from index
buffers of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flashinfer
import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.attention.pages import PageIndex, page_index
from engine.kvcache.pool import KVPool
from engine.kvcache.table import PageTable
from engine.models.kernels import decode_attention_kernel, device_name

# Split-KV partial results live here; 256 MB covers a 256-request decode with long contexts.
WORKSPACE_BYTES = 256 << 20

Wrapper = (
    flashinfer.BatchPrefillWithPagedKVCacheWrapper | flashinfer.BatchDecodeWithPagedKVCacheWrapper
)


@dataclass(frozen=True, slots=True)
class GraphDecode:
    """A decode graph's inputs for engine.kernels.decode: one int32 buffer that `plan_graph`
    fills with one copy (lengths, page indptr, page indices), and the launch's configuration."""

    buf: torch.Tensor
    kv_len: torch.Tensor  # [B]: views into buf
    page_indptr: torch.Tensor  # [B + 1]
    page_indices: torch.Tensor  # [max pages]
    config: Any  # engine.kernels.decode.Config
    workspace: Any  # engine.kernels.decode.Workspace


@dataclass(frozen=True, slots=True)
class FlashInferMeta:
    wrapper: Wrapper | None  # None: a graph that decodes through `decode`
    out_loc: torch.Tensor  # KV slot of every new token, on the device
    decode: GraphDecode | None = None


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    # Decode through FlashInfer's tensor-core (prefill) kernel or its CUDA-core decode kernel.
    # None: tensor cores from 4 query heads per KV head, as SGLang decides. Measured on the H200
    # (Qwen3-0.6B shape, 2 query heads per KV head): CUDA cores 2.57 ms a step at batch 64
    # against 2.71 with tensor cores, the same at batch 1 (the GPU check times both).
    decode_tensor_cores: bool | None = None
    # Decode graphs through engine/kernels/decode.py where the head shape allows it and the
    # device's tuned table (or, untuned, the batch size) says it is faster (None); in every
    # graph the head shape allows (True); never (False).
    graph_decode_kernel: bool | None = None
    # Let FlashInfer split a prefill's KV across CTAs (and merge the parts) when the batch has
    # too few query tiles to fill the GPU; False plans every prefill and mixed step unsplit.
    prefill_split_kv: bool = True
    # FlashInfer's prefill kernel family: "fa2" (the default: its module also serves the
    # tensor-core decode wrapper, one JIT build for both) or "fa3" (Hopper's wgmma/TMA kernels,
    # a second JIT build, minutes: `python -m bench.gpu --fa3` builds it ahead; no split-KV). On
    # the H200 an engine that built it inside its first step gave no step within 100 s.
    prefill_backend: str = "fa2"

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        self.device = pool.k.device
        self.dtype = pool.k.dtype
        self.page_size = pool.page_size
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self.prefill_backend
        )
        tc = self.decode_tensor_cores
        self.tensor_cores = num_heads // num_kv_heads >= 4 if tc is None else tc
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores
        )
        self._graph_indices: torch.Tensor | None = None
        self._paged: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._planned: torch.cuda.Event | None = None
        use = self.graph_decode_kernel is not False
        group = num_heads // num_kv_heads
        self._decode_kernel = decode_attention_kernel(group, head_dim) if use else None

    def prepare(self, layout: BatchLayout) -> FlashInferMeta:
        idx = page_index(layout.table, layout.rows, layout.ends, self.page_size)
        if layout.is_decode:
            self._plan(self.decode, idx)
            return FlashInferMeta(self.decode, layout.out_loc)
        qo_indptr = torch.tensor(layout.qo_indptr, dtype=torch.int32)
        # causal is bottom-right aligned: query i of a chunk sees the prefix and itself
        self._plan(
            self.prefill, idx, qo_indptr, causal=True, disable_split_kv=not self.prefill_split_kv
        )
        return FlashInferMeta(self.prefill, layout.out_loc)

    def attend(self, q: torch.Tensor, layer: int, meta: FlashInferMeta) -> torch.Tensor:
        if (d := meta.decode) is not None:
            return self._decode_kernel.decode_attention(
                q,
                self.pool.k[layer],
                self.pool.v[layer],
                d.kv_len,
                d.page_indptr,
                d.page_indices,
                self.page_size,
                self.scale,
                d.config,
                d.workspace,
            )
        assert meta.wrapper is not None
        return meta.wrapper.run(q, self.pool.paged(layer))

    def attend_into(
        self, q: torch.Tensor, layer: int, meta: FlashInferMeta, out: torch.Tensor
    ) -> None:
        """`attend` into `out` (engine.piecewise_graph: the buffer its next piece reads)."""
        assert meta.wrapper is not None and meta.decode is None
        if self._paged is None:  # the layers' paged views, made once rather than every call
            self._paged = [self.pool.paged(i) for i in range(self.pool.k.shape[0])]
        meta.wrapper.run(q, self._paged[layer], out=out)

    def new_token_slots(self, meta: FlashInferMeta) -> torch.Tensor:
        return meta.out_loc

    # -- CUDA graphs ---------------------------------------------------------------------
    def graph_meta(self, batch_size: int, out_loc: torch.Tensor, max_pages: int) -> FlashInferMeta:
        """A decode wrapper for a graph of `batch_size` rows whose index arrays live in fixed
        buffers; `max_pages` bounds the pages of one batch. Every graph shares the indices
        buffer, since one graph runs at a time."""
        cfg = self._graph_decode_config(batch_size)
        if cfg is not None:
            return self._graph_decode(batch_size, out_loc, max_pages, cfg)
        if self._graph_indices is None or self._graph_indices.numel() < max_pages:
            self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(
                batch_size + 1, dtype=torch.int32, device=self.device
            ),
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=torch.ones(
                batch_size, dtype=torch.int32, device=self.device
            ),
        )
        return FlashInferMeta(wrapper, out_loc)

    def _graph_decode_config(self, g: int) -> Any:
        """engine.kernels.decode's configuration for a graph of g rows, or None (FlashInfer)."""
        mod = self._decode_kernel
        if mod is None:
            return None
        group = self.num_heads // self.num_kv_heads
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        shape = (g, self.num_kv_heads, group, self.head_dim, sms)
        cfg = mod.choose(*shape, device_name(self.device))
        if cfg is None and self.graph_decode_kernel:
            cfg = mod.config_for(*shape)
        return cfg

    def _graph_decode(
        self, g: int, out_loc: torch.Tensor, max_pages: int, cfg: Any
    ) -> FlashInferMeta:
        mod = self._decode_kernel
        assert mod is not None
        group = self.num_heads // self.num_kv_heads
        ws = mod.Workspace.for_batch(
            g, self.num_kv_heads, group, self.head_dim, cfg.splits, self.device
        )
        buf = torch.zeros(2 * g + 1 + max_pages, dtype=torch.int32, device=self.device)
        kv_len, indptr, indices = buf.split([g, g + 1, max_pages])
        return FlashInferMeta(None, out_loc, GraphDecode(buf, kv_len, indptr, indices, cfg, ws))

    def plan_graph(
        self,
        meta: FlashInferMeta,
        table: PageTable,
        rows: list[int],
        lengths: list[int],
        pad_page: int,
    ) -> None:
        """Plan a graph's wrapper for these requests, padded with one-token rows on `pad_page`
        up to the graph's batch size. Call before every replay: plan cannot be captured."""
        pad = meta.out_loc.numel() - len(rows)
        idx = page_index(table, rows, lengths, self.page_size, pad, pad_page)
        if (d := meta.decode) is not None:
            lens = torch.tensor(lengths + [1] * pad, dtype=torch.int32)
            host = torch.cat([lens, idx.indptr, idx.indices])
            # stream-ordered after the step still running, which reads the same buffer
            d.buf[: host.numel()].copy_(host, non_blocking=True)
            return
        assert meta.wrapper is not None
        # on the device already: FlashInfer copies host indices into the graph's buffer with a
        # blocking copy, which would wait for the step still running
        idx = PageIndex(
            idx.indptr, idx.indices.to(self.device, non_blocking=True), idx.last_page_len
        )
        self._plan(meta.wrapper, idx)

    def _plan(self, wrapper: Wrapper, idx: PageIndex, *lead: torch.Tensor, **extra: object) -> None:
        """wrapper.plan for these pages; `lead` is the prefill wrapper's qo_indptr."""
        # plan() sends its schedule to the device from a pinned host buffer without waiting.
        # When steps overlap, the next plan of the same wrapper could rewrite that buffer
        # before the copy ran, so wait for it; it has long run when the device is busy.
        if self._planned is not None:
            self._planned.synchronize()
        wrapper.plan(
            *lead,
            idx.indptr,
            idx.indices,
            idx.last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            **extra,
        )
        self._planned = torch.cuda.Event()
        self._planned.record()
