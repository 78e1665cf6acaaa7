"""Which kernels a layer runs: FlashInfer's fused ones for half-precision CUDA tensors, Triton's
for a float32 residual stream on CUDA and for batch-invariant matmuls, plain torch everywhere
else. FlashInfer and Triton are imported on first use only, so the CPU path never touches them,
and a missing or broken install falls back to torch with one logged reason."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from types import ModuleType

import torch

log = logging.getLogger(__name__)

FUSED_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's norm/RoPE/activation kernels

# The decode kernels of engine/kernels that can be turned off, to measure what they bring
# (`python -m bench.gpu --sections kernels` builds engines both ways in one run): "qkv" (the
# fused norm + RoPE + KV-store epilogue), "gemv" (skinny matmuls for a few rows), "fold" (the
# residual add, RMSNorm and, before the MLP, its activation folded into those GEMVs) and
# "decode" (the one-launch split-KV decode attention in the CUDA graphs), and "pdl" (their
# programmatic dependent launch, engine/kernels/pdl.py). STEPSCOPE_UNFUSED=qkv,gemv,fold,decode,pdl turns them off from
# the start; `set_unfused` in-process.
DECODE_KERNELS = ("qkv", "gemv", "fold", "decode", "pdl")
# On CPU: "onednn", the float32 matmuls through oneDNN on weights reordered once at load
# (`onednn_weight`), in place of F.linear's BLAS
CPU_KERNELS = ("onednn",)
KERNELS = DECODE_KERNELS + CPU_KERNELS
_unfused: frozenset[str] = frozenset()


def set_unfused(names: tuple[str, ...] | list[str]) -> None:
    global _unfused
    unknown = set(names) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; expected some of {KERNELS}")
    _unfused = frozenset(names)
    from engine.kernels import pdl  # torch only: Triton loads when a kernel first launches

    pdl.set_off("pdl" in _unfused)


def _from_environment() -> None:
    names = [n.strip() for n in os.environ.get("STEPSCOPE_UNFUSED", "").split(",") if n.strip()]
    try:
        set_unfused(names)
    except ValueError as e:  # a typo must not quietly measure the wrong thing
        raise ValueError(f"STEPSCOPE_UNFUSED: {e}") from None


_from_environment()


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The flashinfer module when x can use its kernels, else None."""
    if not x.is_cuda or x.dtype not in FUSED_DTYPES:
        return None
    return _flashinfer()


@functools.cache
def _flashinfer() -> ModuleType | None:
    try:
        import flashinfer
    except Exception as e:  # an ImportError, or a broken install raising anything else
        log.warning("fused kernels off, plain torch instead: flashinfer does not import (%s)", e)
        return None
    return flashinfer


def wide_norm(residual: torch.Tensor) -> ModuleType | None:
    """engine.kernels.norm when a float32 residual stream on CUDA can use it, else None."""
    if not residual.is_cuda or residual.dtype != torch.float32:
        return None
    return _triton_norm()


@functools.cache
def _triton_norm() -> ModuleType | None:
    try:
        from engine.kernels import norm
    except Exception as e:  # as for FlashInfer: anything a broken install raises
        log.warning("float32 residual norms unfused: Triton does not import (%s)", e)
        return None
    return norm


@functools.cache
def invariant_linear() -> Callable[..., torch.Tensor]:
    """The batch-invariant matmul (engine.kernels.matmul.linear); the engine checked that Triton
    runs before it turned batch invariance on."""
    from engine.kernels.matmul import linear

    return linear


def qkv_epilogue(qkv: torch.Tensor, head_dim: int) -> ModuleType | None:
    """engine.kernels.qkv when this projection output can use the fused epilogue, else None."""
    if not qkv.is_cuda or qkv.dtype not in FUSED_DTYPES or "qkv" in _unfused:
        return None
    mod = _triton_module("qkv")
    return mod if mod is not None and mod.supports(head_dim) else None


def skinny_gemv(x: torch.Tensor) -> ModuleType | None:
    """engine.kernels.gemv when x is a few half-precision CUDA rows, else None."""
    if not x.is_cuda or x.dtype not in FUSED_DTYPES or "gemv" in _unfused:
        return None
    mod = _triton_module("gemv")
    if mod is None or x.numel() > mod.MAX_ROWS * x.shape[-1]:
        return None
    return mod


def decode_attention_kernel(group: int, head_dim: int) -> ModuleType | None:
    """engine.kernels.decode when decode graphs of this head shape can use it, else None."""
    if "decode" in _unfused:
        return None
    mod = _triton_module("decode")
    return mod if mod is not None and mod.supports(group, head_dim) else None


def folded_gemv(x: torch.Tensor) -> ModuleType | None:
    """engine.kernels.gemv when the norm before a projection of x may fold into its GEMV."""
    return None if "fold" in _unfused else skinny_gemv(x)


@functools.cache
def _triton_module(name: str) -> ModuleType | None:
    import importlib

    try:
        return importlib.import_module(f"engine.kernels.{name}")
    except Exception as e:  # as for FlashInfer: anything a broken install raises
        log.warning("decode kernel %s off, the unfused path instead: %s", name, e)
        return None


# The row count oneDNN reorders a weight for: a prompt step's (it barely matters: decode steps of 8
# rows and prompt steps of 2,048 ran as fast on weights reordered for 128, 512 or 2,048 rows)
ONEDNN_PACK_ROWS = 512


def onednn_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered into oneDNN's blocked layout, for `onednn_linear`, when it is a float32
    CPU weight and torch has oneDNN; else None. On CPU, F.linear's float32 matmul is BLAS (MKL
    in torch's wheels), which takes a slow path on AMD CPUs: oneDNN's runs 2-5x faster there at
    every row count (SmolLM2's projections, 1 to 2,048 rows, 2 threads), as vLLM's CPU backend
    does. Its sums are ordered differently, so results differ from BLAS's in the last bits."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or "onednn" in _unfused:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_PACK_ROWS)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x @ W.T + bias with W reordered by `onednn_weight`; None where x cannot use it (another
    device or dtype, or `onednn` turned off since the weight was reordered)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or "onednn" in _unfused:
        return None
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def device_name(device: torch.device) -> str:
    """The CUDA device's name (its tuned kernel tables are keyed by it)."""
    return torch.cuda.get_device_name(device)
