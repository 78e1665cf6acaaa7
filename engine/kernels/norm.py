"""RMSNorm over a float32 residual stream, with the residual add fused in: the stream stays float32
and the normalized row is rounded once, into the compute dtype. FlashInfer's fused kernel needs
the residual in the compute dtype, so this is what keeps `residual_dtype="float32"` one kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(
    X,
    R,
    W,
    Y,
    H,
    eps,
    stride_x,
    stride_r,
    stride_y,
    HAS_X: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_X:
        r += tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(R + row * stride_r + cols, r, mask=ok)
    inv = tl.rsqrt(tl.sum(r * r, axis=0) / H + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * (r * inv)).to(Y.dtype.element_ty), mask=ok)


def add_rmsnorm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place, float32), then return rmsnorm(residual) * weight in weight's
    dtype. With x None, only the norm."""
    h = residual.shape[-1]
    res = residual.view(-1, h)
    assert res.stride(-1) == 1 and residual.dtype == torch.float32
    out = torch.empty(res.shape, dtype=weight.dtype, device=residual.device)
    xs = None if x is None else x.reshape(-1, h)
    if res.shape[0]:
        _add_rmsnorm_kernel[(res.shape[0],)](
            xs if xs is not None else res,
            res,
            weight,
            out,
            h,
            eps,
            xs.stride(0) if xs is not None else 0,
            res.stride(0),
            out.stride(0),
            HAS_X=xs is not None,
            BLOCK=triton.next_power_of_2(h),
        )
    return out.view(residual.shape)
