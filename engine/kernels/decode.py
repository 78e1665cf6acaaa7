"""Split-KV paged decode attention in one kernel: the partial results meet inside it.

A decode step's attention at small batch is a few hundred KB of K and V per layer, read by too few
programs to fill the GPU unless each request's keys are split. FlashInfer then runs a second
kernel to merge the splits; on the H200 at batch 1 its decode and merge took 10.5 µs a layer
(293 µs a step) for 2.2 MB of keys and values, 5% of the copy rate. Here every program takes one
(request, KV head, split): the query heads that share the KV head (as one tile of CUDA-core
arithmetic, in float32, probabilities included), one slice of the keys through the page table,
an online softmax. It stores its running max, sum and output, and the last program of its
(request, KV head) to finish, counted by an atomic ticket, merges them and writes the output.
So a layer is one launch whatever the split, and the split is fixed per batch size (a CUDA
graph's grid), with slices that are empty for short contexts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.tuned import TunedTable

MAX_GROUP = 4  # query heads per KV head; beyond, FlashInfer's tensor-core decode is the choice
MAX_TILE = 8192  # elements of one [group, keys, head dim] product held in registers
TUNED = Path(__file__).with_name("decode_tuned.json")


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    Out,
    Part,
    Ticket,
    kv_len,
    page_indptr,
    page_indices,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # lengths and pages came from the host before the step: read them before the wait
    n = tl.load(kv_len + b)
    pages = page_indices + tl.load(page_indptr + b)
    span = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N  # whole key blocks per split
    lo = split * span
    hi = tl.minimum(lo + span, n)
    kpos = lo + tl.arange(0, BLOCK_N)
    page = tl.load(pages + kpos // PAGE, mask=kpos < hi, other=0)

    g = tl.arange(0, BLOCK_G)  # with DOT, padded to the 16 rows of a tensor-core tile
    g_ok = g < GROUP
    head = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    if PDL:  # q, and this step's K and V, come from the kernel before
        tl.extra.cuda.gdc_wait()
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        slot = page.to(tl.int64) * PAGE + kpos % PAGE
        nxt = kpos + BLOCK_N  # the next block's pages, read ahead of its keys
        page = tl.load(pages + nxt // PAGE, mask=nxt < hi, other=0)
        off = slot[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        kv_ok = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + off, mask=kv_ok, other=0.0)
        v = tl.load(V + off, mask=kv_ok, other=0.0)
        if DOT:  # bf16 products, float32 sums, as FlashInfer's kernels
            s = tl.dot(q, tl.trans(k)) * sm_scale
        else:  # CUDA cores, all in float32
            qf, kf = q.to(tl.float32), k.to(tl.float32)
            s = tl.sum(qf[:, None, :] * kf[None, :, :], axis=2) * sm_scale
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: a block has a key below `hi`
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        if DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
        m = m_new

    out_ptr = Out + b * stride_ob + head[:, None] * stride_oh + d[None, :]
    out_ok = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        tl.store(out_ptr, (acc / l[:, None]).to(Out.dtype.element_ty), mask=out_ok)
    else:
        # this split's partial: [output (BLOCK_G x BLOCK_D), max (BLOCK_G), sum (BLOCK_G)]
        STRIDE = BLOCK_G * (BLOCK_D + 2)
        pair = b * tl.num_programs(1) + kvh
        base = Part + pair.to(tl.int64) * (SPLITS * STRIDE)
        mine = base + split * STRIDE
        tl.store(mine + g[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(mine + BLOCK_G * BLOCK_D + g, m)
        tl.store(mine + BLOCK_G * BLOCK_D + BLOCK_G + g, l)
        tl.debug_barrier()  # every thread's stores issued before the ticket releases them
        ticket = tl.atomic_add(Ticket + pair, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:  # the last split of this (request, KV head): merge
            sp = tl.arange(0, SPLITS)
            row = base + sp[:, None] * STRIDE + BLOCK_G * BLOCK_D + g[None, :]
            ms = tl.load(row, cache_modifier=".cg")  # [SPLITS, BLOCK_G]; .cg: past L1
            ls = tl.load(row + BLOCK_G, cache_modifier=".cg")
            top = tl.max(ms, axis=0)  # finite: split 0 holds position 0
            w = tl.exp(ms - top[None, :])  # an empty split (max -inf) weighs 0
            total = tl.sum(w * ls, axis=0)
            accs = tl.load(
                base + sp[:, None, None] * STRIDE + g[None, :, None] * BLOCK_D + d[None, None, :],
                cache_modifier=".cg",
            )
            o = tl.sum(w[:, :, None] * accs, axis=0) / total[:, None]
            tl.store(out_ptr, o.to(Out.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(Ticket + pair, 0)  # ready for the next launch


@dataclass(frozen=True)
class Config:
    splits: int  # slices of each request's keys (a power of two)
    block_n: int = 32  # keys per block
    num_warps: int = 4
    num_stages: int = 2
    dot: bool = False  # tensor cores for q.k and p.v, the query heads padded to 16 rows


def supports(group: int, head_dim: int) -> bool:
    return group <= MAX_GROUP and head_dim in (64, 128, 256)


def block_g(group: int, dot: bool) -> int:
    return max(16, triton.next_power_of_2(group)) if dot else triton.next_power_of_2(group)


def block_n_limit(group: int, head_dim: int) -> int:
    """The largest key block whose [group, keys, head dim] product fits the register budget
    of the CUDA-core path."""
    return MAX_TILE // (triton.next_power_of_2(group) * triton.next_power_of_2(head_dim))


def default_splits(batch: int, kv_heads: int, sms: int) -> int:
    """Enough programs to fill the device about twice at this batch size; one split (no
    partials) once the batch alone does."""
    programs = batch * kv_heads
    splits = 1
    while splits < 32 and programs * splits < 2 * sms:
        splits *= 2
    return splits


def config_for(batch: int, kv_heads: int, group: int, head_dim: int, sms: int) -> Config:
    """The configuration of an untuned device: CUDA cores, as measured best at batch 1 on the
    H200 (`python -m bench.gpu --sections kernels`)."""
    return Config(default_splits(batch, kv_heads, sms), min(32, block_n_limit(group, head_dim)))


# (query heads per KV head, head dim) and row class -> the config, or None for FlashInfer's decode
TABLE: TunedTable[Config] = TunedTable(TUNED, ("group", "head_dim"), Config)


def choose(
    batch: int, kv_heads: int, group: int, head_dim: int, sms: int, device: str | None = None
) -> Config | None:
    """The configuration for a decode graph of `batch` rows, or None where FlashInfer's decode
    is faster: the device's tuned table (decode_tuned.json) first; without one, this kernel
    at batch 1 only, where it matched FlashInfer on the H200 before tuning and saved the host
    its plan."""
    found, cfg = TABLE.lookup((group, head_dim), batch, device)
    if found:
        return cfg
    return config_for(batch, kv_heads, group, head_dim, sms) if batch == 1 else None


def set_choice(group: int, head_dim: int, batch: int, cfg: Config | None) -> None:
    """Pin the configuration of a batch size's row class (the GPU check's tuning)."""
    TABLE.pin((group, head_dim), batch, cfg)


def table_rows(device: str) -> dict[str, list[dict]]:
    """The pinned choices, in decode_tuned.json's layout."""
    return TABLE.rows(device)


@dataclass
class Workspace:
    """The partials and tickets of a decode launch, sized for one graph's batch and split;
    shared by its layers (one runs at a time; a launch leaves its tickets at 0)."""

    part: torch.Tensor
    ticket: torch.Tensor

    @staticmethod
    def _per(group: int, head_dim: int) -> int:
        return block_g(group, True) * (triton.next_power_of_2(head_dim) + 2)

    @classmethod
    def for_batch(
        cls, batch: int, kv_heads: int, group: int, head_dim: int, splits: int, device: torch.device
    ) -> Workspace:
        size = max(batch * kv_heads * splits * cls._per(group, head_dim), 1)
        part = torch.empty(size, dtype=torch.float32, device=device)
        return cls(part, torch.zeros(batch * kv_heads, dtype=torch.int32, device=device))

    def fits(self, batch: int, kv_heads: int, group: int, head_dim: int, splits: int) -> bool:
        return (
            self.part.numel() >= batch * kv_heads * splits * self._per(group, head_dim)
            and self.ticket.numel() >= batch * kv_heads
        )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    page_indptr: torch.Tensor,
    page_indices: torch.Tensor,
    page_size: int,
    sm_scale: float,
    config: Config,
    workspace: Workspace,
) -> torch.Tensor:
    """Attention of one query per request, q [B, Hq, D], over the paged cache [slots, Hk, D]:
    request i sees its kv_len[i] positions, in pages page_indices[page_indptr[i]:...]."""
    b, hq, dim = q.shape
    hk = k_cache.shape[1]
    group = hq // hk
    assert hq % hk == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert v_cache.stride() == k_cache.stride()  # V is addressed with K's strides
    assert config.splits & (config.splits - 1) == 0, "splits must be a power of two"
    assert workspace.fits(b, hk, group, dim, config.splits)
    out = torch.empty((b, hq, dim), dtype=q.dtype, device=q.device)
    if b:
        on = pdl.enabled(q)
        _decode_kernel[(b, hk, config.splits)](
            q,
            k_cache,
            v_cache,
            out,
            workspace.part,
            workspace.ticket,
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
            GROUP=group,
            BLOCK_G=block_g(group, config.dot),
            PAGE=page_size,
            HEAD_DIM=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_N=config.block_n,
            SPLITS=config.splits,
            DOT=config.dot,
            PDL=on,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            launch_pdl=on,
        )
    return out
