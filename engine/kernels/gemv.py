"""Skinny matmuls for decode at small batch: y = x @ W.T (+ b) for x of at most 8 rows.

At batch 1 a decode step is weight reads: 1.19 GB for the Qwen3-0.6B shape, 0.28 ms at the
H200's copy rate. cuBLAS's kernels for one row (`nvjet_sm90_tst_8x64`, with a split-K reduce
for some shapes) read the weights at 1.3 TB/s, 31% of that rate, and took 0.9 of the step's
1.7 ms of kernel time. This kernel is a plain GEMV: each program reads `BLOCK_N` whole weight
rows (or a `1 / SPLIT_K` slice of them) in `BLOCK_K` chunks and reduces them against the few
input rows in float32 registers; no tensor cores, no tile of the batch to fill. With
`SPLIT_K > 1` the programs' partial sums meet in a float32 buffer (atomic adds, so the sum's
order, and its last bits, vary from run to run; batch-invariant mode never uses this).
The configuration for a shape is chosen once, by timing (`tune`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 8


@triton.jit
def _gemv_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_span, BLOCK_K):
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=w_ok, other=0.0)
        x_ok = m_ok[:, None] & k_ok[None, :]
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=x_ok, other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = Y + rm[:, None] * stride_ym + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok, sem="relaxed")


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4


DEFAULT = Config(8, 512)
TARGET_PROGRAMS = 264  # two per SM of an H100/H200: enough in flight to keep the copy engine busy

# (N, K, rows) -> a config timed faster than cuBLAS on the device (`tune`), or None: cuBLAS
_table: dict[tuple[int, int, int], Config | None] = {}


def choose(n: int, k: int, rows: int) -> Config | None:
    """The config for an [N, K] weight and `rows` input rows (None: use cuBLAS)."""
    if rows > MAX_ROWS or rows < 1:
        return None
    key = (n, k, rows)
    if key in _table:
        return _table[key]
    block_k = min(512, triton.next_power_of_2(k), MAX_BLOCK // (8 * triton.next_power_of_2(rows)))
    programs = triton.cdiv(n, DEFAULT.block_n)
    split = 1
    while programs * split < TARGET_PROGRAMS and split < 4 and k // (2 * split) >= block_k:
        split *= 2
    cfg = Config(DEFAULT.block_n, block_k, split)
    _table[key] = cfg
    return cfg


def set_choice(n: int, k: int, rows: int, cfg: Config | None) -> None:
    """Pin the config for a shape (the GPU check's tuning, or cuBLAS with None)."""
    _table[(n, k, rows)] = cfg


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config = DEFAULT
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) times weight [N, K] transposed, plus bias."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x2.stride(1) == 1
    split = config.split_k
    y = torch.zeros if split > 1 else torch.empty
    out = y((m, n), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(n, config.block_n), split)
        _gemv_kernel[grid](
            x2,
            weight,
            bias if bias is not None else weight,
            out,
            m,
            n,
            k,
            x2.stride(0),
            weight.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=max(1, triton.next_power_of_2(m)),
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            SPLIT_K=split,
            num_warps=config.num_warps,
        )
    if split > 1:
        out = out.to(x.dtype)
    return out.view(*shape[:-1], n)


CANDIDATES = tuple(
    Config(bn, bk, sk, w)
    for bn in (4, 8, 16)
    for bk in (128, 256, 512, 1024)
    for sk in (1, 2, 4)
    for w in (4,)
    if bn * bk <= 8192
)
# a program multiplies a [rows, BLOCK_N, BLOCK_K] block in registers: keep it this small
MAX_BLOCK = 8192


def fits(cfg: Config, rows: int) -> bool:
    return triton.next_power_of_2(rows) * cfg.block_n * cfg.block_k <= MAX_BLOCK


def tune(
    weight: torch.Tensor,
    rows: int,
    candidates: tuple[Config, ...] = CANDIDATES,
    reps: int = 50,
) -> tuple[Config, float, float]:
    """(the fastest config, its µs, cuBLAS's µs) for `rows` input rows, timed on the device
    (each candidate's result checked against cuBLAS first)."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    ref = torch.nn.functional.linear(x, weight)
    scale = ref.float().abs().max().item() + 1e-6

    def timed(fn: object) -> float:
        # replayed from a CUDA graph, as the engine runs decode: eager launches from Python
        # would take longer than these kernels
        for _ in range(3):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()  # type: ignore[operator]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    base = timed(lambda: torch.nn.functional.linear(x, weight))
    best: tuple[Config, float] | None = None
    for cfg in (c for c in candidates if fits(c, rows)):
        err = (gemv(x, weight, None, cfg).float() - ref.float()).abs().max().item() / scale
        if err > 2e-2:
            raise AssertionError(f"gemv {cfg} is off by {err:.3g} for {tuple(weight.shape)}")
        us = timed(lambda cfg=cfg: gemv(x, weight, None, cfg))
        if best is None or us < best[1]:
            best = (cfg, us)
    assert best is not None
    return best[0], best[1], base
