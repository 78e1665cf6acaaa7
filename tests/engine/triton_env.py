"""For tests of Triton kernels: compiled on CUDA in bf16, or in Triton's interpreter in float32.
Import it before any kernel module: triton.jit reads TRITON_INTERPRET when it decorates."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch


def one_blas_thread() -> bool:
    """numpy's OpenBLAS on one thread. The interpreter's `tl.dot` is a numpy matmul of one tile,
    which OpenBLAS splits over every core: with the cores taken by the suite's other worker, its
    threads wait for each other (a 64 x 64 x 128 product measured 30 ms on two threads, 0.01 ms
    on one). OPENBLAS_NUM_THREADS would come too late: torch has loaded numpy by now. Whether a
    library was found and set."""
    import numpy

    for lib in (Path(numpy.__file__).parent.parent / "numpy.libs").glob("*openblas*"):
        dll = ctypes.CDLL(str(lib))  # the copy numpy loaded: the same path is not loaded twice
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads"):
            if hasattr(dll, name):
                getattr(dll, name)(1)
                return True
    return False


CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    one_blas_thread()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
