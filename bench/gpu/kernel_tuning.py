"""The kernels' tuning: the skinny matmuls (engine/kernels/gemv.py) against cuBLAS, and the
split-KV decode attention kernel (engine/kernels/decode.py) against FlashInfer's, per shape and
row class; each winner is pinned for the rest of the run and written as the device's table."""

from __future__ import annotations

import json
from typing import Any

import torch

from bench.gpu import common
from bench.gpu.common import QWEN_VOCAB, Report, copy_bandwidth, free
from checks.greedy import rel_err
from engine.kvcache.pool import KVPool

GEMV_SHAPES = {  # the Qwen3-0.6B shape's weights, [N, K]
    "qkv_proj": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up_proj": (6144, 1024),
    "down_proj": (1024, 3072),
    "lm_head": (QWEN_VOCAB, 1024),
}


def tune_gemv(r: Report) -> None:
    """The skinny matmuls (engine/kernels/gemv.py) against cuBLAS for every weight of the Qwen3
    shape at 1 to 64 rows, each call of a CUDA graph of 50 on another copy of the weight (so it
    comes from memory, as in a decode step, not from L2); the fastest is pinned for the rest of
    the run (`gemv.set_choice`) and the table written to OUT/gemv_tuned.json."""
    from engine.kernels import gemv as G

    bw = copy_bandwidth(r)
    rows, raw = [], []
    for name, (n, k) in GEMV_SHAPES.items():
        w = torch.randn(n, k, device=common.DEV, dtype=torch.bfloat16) / k**0.5
        for m in (1, 2, 4, 8, 16, 32, 64):
            if r.left() < 20:
                r.say("(skipped the rest of the GEMV tuning: past the deadline)")
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


# decode attention alone: the graphs' row classes tuned at one context, and the kernel options
DECODE_CLASSES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXT = 535  # the decode rows' mean context (512-token prompts, 128 new tokens)
DECODE_LAYERS = 28  # one launch per layer, each over its own layer's cache (more than L2 holds)


def decode_neighbours(cfg: Any, group: int, head_dim: int) -> list[Any]:
    """The configurations one option away from cfg, for a coordinate-descent tuning: the other
    arithmetic (tensor or CUDA cores), half and twice the split, the other key blocks, warps."""
    from dataclasses import replace

    from engine.kernels.decode import block_n_limit

    out = [replace(cfg, dot=not cfg.dot)]
    out += [replace(cfg, splits=sp) for sp in (cfg.splits // 2, cfg.splits * 2) if 1 <= sp <= 64]
    cap = 64 if cfg.dot else 2 * block_n_limit(group, head_dim)
    out += [replace(cfg, block_n=bn) for bn in (16, 32, 64) if bn != cfg.block_n and bn <= cap]
    out += [replace(cfg, num_warps=w) for w in (2, 4, 8) if w != cfg.num_warps]
    return out


def decode_step_us(
    case: tuple[Any, ...], use_kernel: bool, cfg: Any = None
) -> tuple[float, torch.Tensor]:
    """(µs of one decode step's attention, all layers, replayed from a CUDA graph; the last
    layer's output after the replays): FlashInfer's decode wrapper, or engine/kernels/decode.py
    in `cfg` (None: the engine's choice)."""
    from engine.attention import flashinfer_backend as FB
    from engine.kernels import decode as D

    pool, table, q, ctx, pages_per = case
    bs, hq, hd = q.shape
    chosen = D.choose
    FB.FlashInferAttention.graph_decode_kernel = use_kernel
    if cfg is not None:
        D.choose = lambda *a, **k: cfg
    try:
        be = FB.FlashInferAttention(pool, hq, pool.k.shape[2], hd)
        loc = torch.zeros(bs, dtype=torch.int64, device=common.DEV)
        meta = be.graph_meta(bs, loc, bs * (pages_per + 1))
        assert (meta.decode is not None) == use_kernel
    finally:
        FB.FlashInferAttention.graph_decode_kernel = None
        D.choose = chosen
    be.plan_graph(meta, table, list(range(bs)), [ctx] * bs, 0)
    for layer in range(2):
        be.forward(q, None, None, layer, meta)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(DECODE_LAYERS):
            out = be.forward(q, None, None, layer, meta)
    be.plan_graph(meta, table, list(range(bs)), [ctx] * bs, 0)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / 10, out.clone()


def tune_decode_attention(r: Report) -> None:
    """Decode attention alone, replayed from CUDA graphs of one launch per layer, per row class
    of the decode graphs: FlashInfer's decode wrapper (a kernel and its split-KV merge) against
    engine/kernels/decode.py, tuned by coordinate descent from its default. The winners are
    pinned for the rest of the run and written to OUT/decode_tuned.json, the table the engine
    ships per device (engine/kernels/)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from engine.kernels import decode as D

    bw = copy_bandwidth(r)
    hq, hk, hd, page, ctx = 16, 8, 128, 16, DECODE_CONTEXT
    group = hq // hk
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, raw = [], {}
    for bs in DECODE_CLASSES:
        if r.left() < 45:
            r.say(f"(skipped decode attention at batch {bs}: past the deadline)")
            continue
        pages_per = -(-ctx // page)
        num_pages = bs * pages_per + 2
        pool = KVPool(
            DECODE_LAYERS, num_pages, page, hk, hd, torch.bfloat16, torch.device(common.DEV)
        )
        pool.k.normal_()
        pool.v.normal_()
        perm = torch.randperm(num_pages - 1)[: bs * pages_per] + 1  # page 0: the padding page
        slots = torch.zeros(bs, pages_per * page + page, dtype=torch.int64)
        slots[:, : pages_per * page] = (
            perm.view(bs, pages_per, 1) * page + torch.arange(page)
        ).view(bs, -1)
        case = (pool, SimpleNamespace(slots=slots), torch.randn(bs, hq, hd, dtype=torch.bfloat16,
                device=common.DEV), ctx, pages_per)  # fmt: skip
        kv_bytes = DECODE_LAYERS * bs * ctx * hk * hd * 2 * 2
        fi_us, fi_out = decode_step_us(case, False)
        tried: dict[Any, float] = {}

        def run(
            cfg: Any,
            case: Any = case,
            tried: dict[Any, float] = tried,
            bs: int = bs,
            fi_out: torch.Tensor = fi_out,
        ) -> float:
            if cfg not in tried:
                try:
                    us, out = decode_step_us(case, True, cfg)
                    # like gemv.tune: a configuration is timed only once its output is right
                    err = rel_err(out.float(), fi_out.float())
                    if err > 2e-2:
                        raise AssertionError(f"off FlashInfer's output by {err:.3g}")
                    tried[cfg] = us
                except Exception as e:  # does not compile, or is wrong: say so, go on
                    r.say(f"decode batch {bs} {cfg}: {type(e).__name__}: {str(e)[:160]}")
                    tried[cfg] = float("inf")
            return tried[cfg]

        default = D.config_for(bs, hk, group, hd, sms)
        best = min((default, replace(default, dot=True, block_n=32)), key=run)
        for _ in range(2):  # two passes over the options
            for cfg in decode_neighbours(best, group, hd):
                if run(cfg) < run(best):
                    best = cfg
        mine = run(best)
        choice = best if mine <= fi_us else None
        D.set_choice(group, hd, bs, choice)
        raw[str(bs)] = {"flashinfer_us": fi_us, "best": repr(best), "best_us": mine,
                        "default_us": run(default),
                        "tried": {repr(c): us for c, us in tried.items()}}  # fmt: skip
        name = (
            f"{'tensor' if best.dot else 'CUDA'} cores, splits {best.splits}, keys "
            f"{best.block_n}, warps {best.num_warps}"
        )
        rows.append([bs, fi_us, run(default), name, mine, fi_us / mine,
                     "this kernel" if choice else "FlashInfer", kv_bytes / bw * 1e6,
                     kv_bytes / (min(mine, fi_us) * 1e-6) / 1e9])  # fmt: skip
        print(bs, fi_us, best, mine, len(tried), flush=True)
        del pool, case
        free()
    r.data["decode_attention"] = raw
    device = torch.cuda.get_device_name(0)
    (r.out / "decode_tuned.json").write_text(json.dumps(D.table_rows(device), indent=1) + "\n")
    r.table(
        f"Decode attention alone, {DECODE_LAYERS} layers (one graph), Qwen3-0.6B heads "
        f"({hq} q, {hk} KV, dim {hd}), page {page}, context {ctx}: µs per step",
        ["batch", "FlashInfer", "this kernel, untuned default", "this kernel, tuned",
         "its µs", "FlashInfer / tuned", "the graphs use", "floor (KV bytes at copy rate)",
         "GB/s of the faster"],
        rows,
    )  # fmt: skip
