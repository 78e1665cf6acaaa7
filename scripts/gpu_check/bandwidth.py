"""bandwidth: device-to-device copy rate, the denominator of every memory floor."""

from __future__ import annotations

import torch

from scripts.gpu_check import common
from scripts.gpu_check.common import free
from scripts.gpu_check.report import Report


def sec_bandwidth(r: Report) -> None:
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device=common.DEV)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / 20
    bw = 2 * n / (ms / 1e3)  # bytes read plus bytes written
    r.data["copy_bw"] = bw
    r.table(
        "Copy bandwidth (device to device, read + write)",
        ["bytes copied", "ms", "TB/s"],
        [[f"{n / 2**30:.0f} GiB", ms, bw / 1e12]],
    )
    del x, y
    free()
