"""A batch-invariant matmul: each output row comes out with the same bits whatever the number of
rows beside it.

cuBLAS picks its kernel, tiling and split-K by the shape, so a row computed in a batch of 3 and in
a batch of 3,000 can round differently. Here the tile shape depends only on the weight's shape, and
each output tile reduces over K in one program, in the same order, every time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_K, GROUP_M = 64, 64, 8


@triton.jit
def _matmul_kernel(
    A,
    W,
    C,
    bias,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grouped launch order: programs running together share rows of A and columns of W in L2
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    w_ptr = W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # W^T's [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptr = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def block_n(n: int) -> int:
    """Columns per program, from the weight alone: narrow weights get narrower tiles so that
    a few-row (decode) matmul still spreads over many programs."""
    return 64 if n <= 2048 else 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, as nn.functional.linear, batch-invariant over x's leading dims."""
    n, k = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    a = x.reshape(-1, k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m = a.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        bn = block_n(n)
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, bn),)
        _matmul_kernel[grid](
            a,
            weight,
            out,
            bias if bias is not None else weight,  # any pointer: not read without a bias
            m,
            n,
            k,
            a.stride(0),
            weight.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=bn,
            BLOCK_K=BLOCK_K,
            GROUP_M=GROUP_M,
            num_warps=4,
            num_stages=3,
        )
    return out.view(*x.shape[:-1], n)
