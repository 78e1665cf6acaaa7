"""gemv: the skinny matmuls (engine/kernels/gemv.py) against cuBLAS at the Qwen3-0.6B shapes."""

from __future__ import annotations

import json

import torch

from scripts.gpu_check import common
from scripts.gpu_check.common import QWEN_VOCAB, free
from scripts.gpu_check.report import Report

GEMV_SHAPES = {  # the Qwen3-0.6B shape's weights, [N, K]
    "qkv_proj": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up_proj": (6144, 1024),
    "down_proj": (1024, 3072),
    "lm_head": (QWEN_VOCAB, 1024),
}


def sec_gemv(r: Report) -> None:
    """The skinny matmuls (engine/kernels/gemv.py) against cuBLAS for every weight of the Qwen3
    shape at 1 to 64 rows, each call of a CUDA graph of 50 on another copy of the weight (so it
    comes from memory, as in a decode step, not from L2); the fastest is pinned for the sections
    after this one (`gemv.set_choice`) and the table saved as gemv_tuned.json."""
    from engine.kernels import gemv as G

    bw = r.data.get("copy_bw") or 4.1e12
    rows, raw = [], []
    for name, (n, k) in GEMV_SHAPES.items():
        w = torch.randn(n, k, device=common.DEV, dtype=torch.bfloat16) / k**0.5
        for m in (1, 2, 4, 8, 16, 32, 64):
            if r.left() < 20:
                r.say("(gemv: out of time)")
                break
            cfg, us, base = G.tune(w, m)
            G.set_choice(n, k, m, cfg)
            floor = n * k * 2 / bw * 1e6
            rows.append([name, m, base, us, base / us, floor, f"{cfg}" if cfg else "cuBLAS"])
            raw.append(dict(weight=name, n=n, k=k, rows=m, cublas_us=base, best_us=us,
                            floor_us=floor, config=vars(cfg) if cfg else None))  # fmt: skip
        del w
        free()
    r.data["gemv"] = raw
    tuned = G.table_rows(torch.cuda.get_device_name())
    (r.out / "gemv_tuned.json").write_text(json.dumps(tuned, indent=1) + "\n")
    r.table(
        "Skinny matmuls against cuBLAS (µs per call, from a CUDA graph of 50 over copies)",
        ["weight", "rows", "cuBLAS µs", "best µs", "speed-up", "copy floor µs", "chosen"],
        rows,
    )
