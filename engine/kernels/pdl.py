"""Programmatic dependent launch (Hopper and later) for the decode kernels of engine/kernels.

A decode step at small batch is a chain of some 180 kernels of a few µs each, and each one pays
its ramp: the launch, then the first loads' round trip to memory. A kernel launched with PDL may
start while the one before it finishes; it reads what the previous kernel cannot have written
(its weights, the index arrays the host copied before the step), then `gdc_wait` holds it until
that kernel has completed and its writes are visible. Every kernel that launches this way waits
before any other load or any store, so the chain stays ordered: a kernel completes only after
the one before it did. Kernels that are not launched this way (cuBLAS, FlashInfer, torch) wait
for their predecessors as usual.

Used where Triton has it and the device is sm_90 or later, unless turned off
(`STEPSCOPE_UNFUSED=pdl`, engine.models.kernels); CUDA graphs keep the launch attribute.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

_off = False


def set_off(off: bool) -> None:
    global _off
    _off = off


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels reading or writing x's device launch with PDL."""
    if _off or not x.is_cuda:
        return False
    index = x.device.index or 0
    if index not in _probed and torch.cuda.is_current_stream_capturing():
        return False  # the probe captures a graph of its own: not inside another capture
    return _supported(index)


_probed: set[int] = set()


@functools.cache
def _supported(index: int) -> bool:
    _probed.add(index)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        return _probe(index)
    except Exception as e:  # an older Triton, a driver without it: launch as before
        log.warning("programmatic dependent launch off: %s", e)
        return False


def _probe(index: int) -> bool:
    """Launch two dependent kernels eagerly and from a captured graph, and check their result."""
    import triton
    import triton.language as tl

    if not hasattr(tl.extra.cuda, "gdc_wait"):
        log.info("programmatic dependent launch off: this Triton has no gdc_wait")
        return False

    @triton.jit
    def _add_one(X, Y):
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        tl.store(Y + tl.arange(0, 32), tl.load(X + tl.arange(0, 32)) + 1)

    dev = torch.device("cuda", index)
    x = torch.zeros(32, dtype=torch.int32, device=dev)
    y, z = torch.empty_like(x), torch.empty_like(x)

    def chain() -> None:
        _add_one[(1,)](x, y, launch_pdl=True)
        _add_one[(1,)](y, z, launch_pdl=True)

    chain()
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    # thread-local: under tensor parallelism NCCL's watchdog thread queries events meanwhile
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        chain()
    x.fill_(5)
    graph.replay()
    torch.cuda.synchronize(dev)
    return bool((z == 7).all())
