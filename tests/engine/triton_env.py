"""For tests of Triton kernels: compiled on CUDA in bf16, or in Triton's interpreter in float32.
Import it before any kernel module: triton.jit reads TRITON_INTERPRET when it decorates."""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
