"""Batch-invariant paged attention: one Triton kernel for prompts, chunks and decodes.

A program takes one tile of a request's queries for one KV head: up to BLOCK_M rows, each a query
position with one of the query heads that share the KV head. It walks the request's keys through
the page table in blocks of BLOCK_N aligned to position 0, with an online softmax, and is never
split. Each row's arithmetic is then the same whatever shares its tile or its batch: a key block
that a row may not see leaves its running max, sum and output bit for bit unchanged. So a prompt
prefilled whole, in chunks, or from a prefix-cache hit, alone or in any batch, attends to the same
bits; that is what makes chunked prefill give the very tokens an unchunked one gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # query rows per program: query positions x query heads of one KV group
BLOCK_N = 64  # keys per block


@triton.jit
def _paged_attention_kernel(
    Q,
    K,
    V,
    Out,
    tile_req,
    tile_q0,
    qo_indptr,
    kv_len,
    page_indptr,
    page_indices,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(tile_req + tile)
    q0 = tl.load(tile_q0 + tile)  # the tile's first query, counted within its request
    qs = tl.load(qo_indptr + req)
    qn = tl.load(qo_indptr + req + 1) - qs
    kv_n = tl.load(kv_len + req)  # keys after this step; the queries are the last qn of them
    pages = page_indices + tl.load(page_indptr + req)

    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    valid = (qi < qn) & (rows < (BLOCK_M // GROUP) * GROUP)
    qpos = tl.where(valid, kv_n - qn + qi, -1)  # a padding row sees no key
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (qs + qi).to(tl.int64)
    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid[:, None] & d_ok[None, :],
        other=0.0,
    )

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = tl.minimum(kv_n, kv_n - qn + q0 + BLOCK_M // GROUP)  # past the tile's last query
    for start in range(0, end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < kv_n
        page = tl.load(pages + kpos // PAGE, mask=k_ok, other=0)
        slot = page.to(tl.int64) * PAGE + kpos % PAGE
        kv_off = slot[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        s = tl.where((kpos[None, :] <= qpos[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(
        Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=valid[:, None] & d_ok[None, :],
    )


def queries_per_tile(group: int) -> int:
    return BLOCK_M // group


def tiles(qo_lens: list[int], group: int) -> tuple[list[int], list[int]]:
    """(request, first query) of every tile, covering each request's queries."""
    per = queries_per_tile(group)
    reqs: list[int] = []
    firsts: list[int] = []
    for i, n in enumerate(qo_lens):
        starts = range(0, n, per)
        reqs += [i] * len(starts)
        firsts += starts
    return reqs, firsts


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tile_req: torch.Tensor,
    tile_q0: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_len: torch.Tensor,
    page_indptr: torch.Tensor,
    page_indices: torch.Tensor,
    page_size: int,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged cache [slots, Hk, D]. Request i owns
    queries qo_indptr[i]:qo_indptr[i+1], the last of its kv_len[i] positions, whose KV sits in
    pages page_indices[page_indptr[i]:...]. The tile arrays (from `tiles`) set the grid: their
    length is fixed for a CUDA graph while their contents change."""
    t, hq, dim = q.shape
    hk = k_cache.shape[1]
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and hq % hk == 0
    out = torch.empty((t, hq, dim), dtype=q.dtype, device=q.device)
    n_tiles = tile_req.numel()
    if n_tiles and t:
        _paged_attention_kernel[(n_tiles, hk)](
            q,
            k_cache,
            v_cache,
            out,
            tile_req,
            tile_q0,
            qo_indptr,
            kv_len,
            page_indptr,
            page_indices,
            sm_scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            out.stride(0),
            out.stride(1),
            GROUP=hq // hk,
            PAGE=page_size,
            HEAD_DIM=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            num_warps=4,
            num_stages=2,
        )
    return out
