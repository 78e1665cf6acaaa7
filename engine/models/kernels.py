"""Which kernels a layer runs: FlashInfer's fused ones for half-precision CUDA tensors, plain
torch everywhere else. FlashInfer is imported on the first CUDA call only, so the CPU path never
touches it, and a missing or broken install falls back to torch with one logged reason."""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

log = logging.getLogger(__name__)

FUSED_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's norm/RoPE/activation kernels


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
