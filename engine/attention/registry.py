"""Choosing the attention backend: FlashInfer on CUDA when it imports, torch otherwise; the
batch-invariant Triton backend when asked for by name."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.config import ATTENTION_BACKENDS
from engine.kvcache.pool import KVPool

log = logging.getLogger(__name__)


def create_backend(
    name: str, device: torch.device, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}")
    if name == "triton":
        from engine.kernels import triton_unavailable

        if (reason := triton_unavailable(device.type)) is not None:
            raise RuntimeError(f"the triton backend is unavailable: {reason}")
        from engine.attention.triton_backend import TritonAttention

        return TritonAttention(pool, num_heads, num_kv_heads, head_dim)
    if name == "flashinfer" or (name == "auto" and device.type == "cuda"):
        reason = _flashinfer_unavailable(device)
        if reason is None:
            from engine.attention.flashinfer_backend import FlashInferAttention

            return FlashInferAttention(pool, num_heads, num_kv_heads, head_dim)
        if name == "flashinfer":
            raise RuntimeError(f"the flashinfer backend is unavailable: {reason}")
        log.warning("attention: falling back to torch (%s)", reason)
    from engine.attention.torch_backend import TorchAttention

    return TorchAttention(pool, num_heads, num_kv_heads, head_dim)


def _flashinfer_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"FlashInfer needs CUDA, the device is {device.type}"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install raising anything else
        return f"flashinfer does not import: {e}"
    try:
        import engine.attention.flashinfer_backend  # noqa: F401
    except ImportError as e:
        return f"the FlashInfer backend module is missing: {e}"
    return None
