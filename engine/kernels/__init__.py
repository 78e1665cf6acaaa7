"""Triton kernels: the batch-invariant matmul and paged attention, and the RMSNorm of a float32
residual stream. Imported only where used: Triton is never loaded on the default CPU path."""

from __future__ import annotations

import importlib.util
import os


def triton_unavailable(device_type: str) -> str | None:
    """Why the Triton kernels cannot run on this device, or None when they can. Off CUDA they
    run only under Triton's interpreter (TRITON_INTERPRET=1), which the CPU tests use."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Triton kernels need CUDA (or TRITON_INTERPRET=1), the device is {device_type}"
    return None
