"""The attention layer's epilogue in one kernel: per-head q/k RMSNorm (Qwen3), RoPE on q and k,
and the new K and V written into the paged pool.

Unfused, a decode layer runs five kernels between the QKV projection and attention (two norms,
RoPE, two `index_copy` for K and V); at batch 1 they took 300 µs of a 1.7 ms step on the H200,
each one a few µs of launch and ramp for a few KB of data. Here one program handles one
(token, head) row of `head_dim` values: it normalizes in float32, rotates in float32 and rounds
once, where the unfused path rounds after the norm and again after RoPE.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl


@triton.jit
def _qkv_epilogue_kernel(
    QKV,
    POS,
    COS_SIN,
    QW,
    KW,
    Q_OUT,
    K_CACHE,
    V_CACHE,
    LOC,
    stride_qkv,
    stride_cs,
    eps,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the slots and positions came from the host before the step: read them first
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    row = QKV + t * stride_qkv + h * D
    slot = tl.load(LOC + t).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if h >= HQ + HK:  # a V head: copied as it is
        dst = V_CACHE + slot * (HK * D) + (h - HQ - HK) * D
        tl.store(dst + half, tl.load(row + half))
        tl.store(dst + D // 2 + half, tl.load(row + D // 2 + half))
    else:
        x1 = tl.load(row + half).to(tl.float32)
        x2 = tl.load(row + D // 2 + half).to(tl.float32)
        if HAS_NORM:
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            if h < HQ:
                w1 = tl.load(QW + half).to(tl.float32)
                w2 = tl.load(QW + D // 2 + half).to(tl.float32)
            else:
                w1 = tl.load(KW + half).to(tl.float32)
                w2 = tl.load(KW + D // 2 + half).to(tl.float32)
            x1 = x1 * inv * w1
            x2 = x2 * inv * w2
        cos = tl.load(COS_SIN + pos * stride_cs + half)
        sin = tl.load(COS_SIN + pos * stride_cs + D // 2 + half)
        o1 = x1 * cos - x2 * sin  # neox layout: the halves rotate against each other
        o2 = x2 * cos + x1 * sin
        if h < HQ:
            dst = Q_OUT + t * (HQ * D) + h * D
        else:
            dst = K_CACHE + slot * (HK * D) + (h - HQ) * D
        tl.store(dst + half, o1.to(Q_OUT.dtype.element_ty))
        tl.store(dst + D // 2 + half, o2.to(Q_OUT.dtype.element_ty))


# Warps per (token, head) program. One warp would cover a 128-wide head, but on the H200 a
# 512-token chunk's epilogue took the same time at 1 warp as at 4 (0.570 against 0.571 ms a step
# for 28 layers): its time is the wait for the projection before it, which
# it overlaps under programmatic dependent launch. Kept at Triton's default.
NUM_WARPS = 4


def supports(head_dim: int) -> bool:
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def qkv_epilogue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """q as [T, Hq, D] (normed and rotated); K (normed, rotated) and V written into
    `k_cache` / `v_cache` ([slots, Hk, D], one layer's pool) at `slots`.

    `qkv` is the projection's output [T, (Hq + 2 Hk) D]; `cos_sin` is [positions, cos | sin] in
    float32 (RotaryEmbedding.cos_sin); the norm weights are both given or both None."""
    n = qkv.shape[0]
    assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and supports(head_dim)
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        has_norm = q_weight is not None and k_weight is not None
        _qkv_epilogue_kernel[(n, num_heads + 2 * num_kv_heads)](
            qkv,
            positions,
            cos_sin,
            q_weight if has_norm else qkv,
            k_weight if has_norm else qkv,
            q,
            k_cache,
            v_cache,
            slots,
            qkv.stride(0),
            cos_sin.stride(0),
            eps,
            HQ=num_heads,
            HK=num_kv_heads,
            D=head_dim,
            HAS_NORM=has_norm,
            PDL=(on := pdl.enabled(qkv)),
            launch_pdl=on,
            num_warps=NUM_WARPS,
        )
    return q
