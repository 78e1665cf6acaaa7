"""Skinny matmuls for decode at small batch: y = x @ W.T (+ b) for x of at most 64 rows.

At batch 1 a decode step is weight reads: 1.19 GB for the Qwen3-0.6B shape, 0.28 ms at the
H200's copy rate. cuBLAS's kernels for one row (`nvjet_sm90_tst_8x64`, with a split-K reduce
for some shapes) read the weights at 1.3 TB/s, 31% of that rate, and took 0.9 of the step's
1.7 ms of kernel time. This kernel is a plain GEMV: each program reads `BLOCK_N` whole weight
rows (or a `1 / SPLIT_K` slice of them) in `BLOCK_K` chunks and reduces them against the few
input rows in float32 registers; no tensor cores, no tile of the batch to fill. With
`SPLIT_K > 1` the programs' partial sums meet in a float32 buffer (atomic adds, so the sum's
order, and its last bits, vary from run to run; batch-invariant mode never uses this).
From 9 to 64 rows the same loop runs on tensor cores (`tl.dot` over one tile of all the rows):
cuBLAS's kernels for 64 rows read these small weights (2 to 12 MB) at 36% of the copy rate.

Which kernel and configuration serve a shape is decided by timing (`tune`, run by the GPU check
on the device, every candidate checked against cuBLAS first); the winners measured on an H200
are kept in gemv_tuned.json and used on a device of that name. Elsewhere the few rows path
takes a heuristic configuration and more rows go to cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.tuned import TunedTable

MAX_ROWS = 64  # rows beyond this go to cuBLAS
GEMV_ROWS = 8  # up to this many rows, the CUDA-core loop; beyond, tensor cores
TUNED = Path(__file__).with_name("gemv_tuned.json")


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
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the first weight block before the wait: no kernel of this step writes weights
    rk = k_lo + tl.arange(0, BLOCK_K)
    w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :],
                other=0.0)  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, k_span, BLOCK_K):
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x_ok = m_ok[:, None] & k_ok[None, :]
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=x_ok, other=0.0)
        nk = rk + BLOCK_K  # the next block's weights, loaded while this one is reduced
        nk_ok = nk < tl.minimum(K, k_lo + k_span)  # within this split's span
        w_next = tl.load(W + rn[:, None] * stride_wn + nk[None, :],
                         mask=n_ok[:, None] & nk_ok[None, :], other=0.0)  # fmt: skip
        if DOT:  # tensor cores, over one tile of all the rows
            acc = tl.dot(x, tl.trans(w), acc)
        else:  # CUDA cores: a few rows, reduced in float32 registers
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        w = w_next
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = Y + rm[:, None] * stride_ym + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok, sem="relaxed")


@triton.jit
def _norm_gemv_kernel(
    X,
    R,
    R_out,
    NW,
    W,
    B,
    Y,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_rm,
    stride_om,
    stride_wn,
    stride_ym,
    HAS_X: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """y = norm(x + r) @ W.T (+ b), and r_out = x + r; with ACT, W is [gate; up] (2N rows)
    and y = silu(gate) * up. Rounded where Hugging Face's modules round: the residual sum, the
    normalized row, its product with the norm weight, the projection, the activation."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    dtype = W.dtype.element_ty
    # the first weight block before the wait: no kernel of this step writes weights
    rk = tl.arange(0, BLOCK_K)
    w_ok = n_ok[:, None] & (rk < K)[None, :]
    w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=w_ok, other=0.0)
    wu = w
    if ACT:
        wu = tl.load(W + (rn + N)[:, None] * stride_wn + rk[None, :], mask=w_ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # the row's mean square: every program reads the few rows whole (from L2 after the first)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        ok = m_ok[:, None] & (rk < K)[None, :]
        h = tl.load(R + rm[:, None] * stride_rm + rk[None, :], mask=ok, other=0.0)
        if HAS_X:
            h = (h.to(tl.float32) + tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=ok,
                                            other=0.0).to(tl.float32)).to(dtype)  # fmt: skip
        hf = h.to(tl.float32)
        sq += tl.sum(hf * hf, axis=1)
    inv = tl.rsqrt(sq / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        ok = m_ok[:, None] & k_ok[None, :]
        h = tl.load(R + rm[:, None] * stride_rm + rk[None, :], mask=ok, other=0.0)
        if HAS_X:
            h = (h.to(tl.float32) + tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=ok,
                                            other=0.0).to(tl.float32)).to(dtype)  # fmt: skip
            if pid == 0:  # one program writes the new residual stream
                tl.store(R_out + rm[:, None] * stride_om + rk[None, :], h, mask=ok)
        nw = tl.load(NW + rk, mask=k_ok, other=0.0).to(tl.float32)
        xn = (h.to(tl.float32) * inv[:, None]).to(dtype).to(tl.float32)
        xn = (xn * nw[None, :]).to(dtype).to(tl.float32)
        nk = rk + BLOCK_K  # the next block's weights, loaded while this one is reduced
        nw_ok = n_ok[:, None] & (nk < K)[None, :]
        w_next = tl.load(W + rn[:, None] * stride_wn + nk[None, :], mask=nw_ok, other=0.0)
        acc += tl.sum(xn[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        w = w_next
        if ACT:
            wu_next = tl.load(W + (rn + N)[:, None] * stride_wn + nk[None, :], mask=nw_ok,
                              other=0.0)  # fmt: skip
            acc_up += tl.sum(xn[:, None, :] * wu.to(tl.float32)[None, :, :], axis=2)
            wu = wu_next
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    out = Y + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    dot: bool = False  # the tensor-core kernel (more than GEMV_ROWS rows)


DEFAULT = Config(8, 512)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config = DEFAULT
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) times weight [N, K] transposed, plus bias."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    limit = MAX_ROWS if config.dot else GEMV_ROWS
    assert m <= limit and weight.shape[1] == k and weight.stride(1) == 1 and x2.stride(1) == 1
    split = config.split_k
    y = torch.zeros if split > 1 else torch.empty
    out = y((m, n), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(n, config.block_n), split)
        block_m = max(16 if config.dot else 1, triton.next_power_of_2(m))
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
            BLOCK_M=block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            SPLIT_K=split,
            DOT=config.dot,
            PDL=(on := pdl.enabled(x2)),
            num_warps=config.num_warps,
            launch_pdl=on,
        )
    if split > 1:
        out = out.to(x.dtype)
    return out.view(*shape[:-1], n)


def norm_gemv(
    x: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: Config,
    act: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) @ weight.T + bias, x + residual) for a few rows, in one kernel: the
    residual add and RMSNorm before a projection, folded into its GEMV. With `act`, weight is
    the fused [gate; up] projection and the first result silu(gate) * up. x None: the norm of
    `residual` alone (the first layer), which is returned as it is."""
    h = residual.shape[-1]
    r2 = residual.reshape(-1, h)
    m = r2.shape[0]
    n = weight.shape[0] // 2 if act else weight.shape[0]
    assert m <= GEMV_ROWS and weight.shape[1] == h and weight.stride(1) == 1 and r2.stride(1) == 1
    assert not config.dot and config.split_k == 1 and not (act and bias is not None)
    # the new residual is rounded to the weights' dtype: a float32 stream must not come here
    assert residual.dtype == weight.dtype and (x is None or x.dtype == weight.dtype)
    x2 = None if x is None else x.reshape(-1, h)
    assert x2 is None or x2.stride(1) == 1
    # not in place: every program reads the residual that one of them rewrites
    r_out = r2 if x2 is None else torch.empty((m, h), dtype=r2.dtype, device=r2.device)
    y = torch.empty((m, n), dtype=weight.dtype, device=weight.device)
    block_n = max(1, config.block_n // 2) if act else config.block_n  # weight rows per program
    if m:
        _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
            x2 if x2 is not None else r2,
            r2,
            r_out,
            norm_weight,
            weight,
            bias if bias is not None else weight,
            y,
            m,
            n,
            h,
            eps,
            x2.stride(0) if x2 is not None else 0,
            r2.stride(0),
            r_out.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_X=x2 is not None,
            HAS_BIAS=bias is not None,
            ACT=act,
            BLOCK_M=triton.next_power_of_2(m),
            BLOCK_N=block_n,
            BLOCK_K=config.block_k,
            PDL=(on := pdl.enabled(r2)),
            num_warps=config.num_warps,
            launch_pdl=on,
        )
    return y.view(*residual.shape[:-1], n), r_out.view(residual.shape)


def foldable(cfg: Config | None) -> bool:
    """Whether a shape's tuned config can take the norm (and activation) folded in."""
    return cfg is not None and not cfg.dot and cfg.split_k == 1


# the search space, narrowed by a first H200 run (2026-12-01, call 1): every winner at 1 to 8
# rows had BLOCK_N 4 or 8, BLOCK_K 512 or 1024 and no split
CANDIDATES = tuple(Config(bn, bk, sk) for bn in (4, 8) for bk in (256, 512, 1024) for sk in (1, 2))
DOT_CANDIDATES = tuple(
    Config(bn, bk, sk, dot=True) for bn in (16, 32, 64) for bk in (64, 128) for sk in (1, 2, 4)
)
# a CUDA-core program multiplies a [rows, BLOCK_N, BLOCK_K] block in registers: this small
MAX_BLOCK = 8192


def fits(cfg: Config, rows: int) -> bool:
    if cfg.dot:
        return GEMV_ROWS < rows <= MAX_ROWS
    return (
        rows <= GEMV_ROWS and triton.next_power_of_2(rows) * cfg.block_n * cfg.block_k <= MAX_BLOCK
    )


# (N, K) and row class -> the config to use, or None for cuBLAS
TABLE: TunedTable[Config] = TunedTable(TUNED, ("n", "k"), Config)


def choose(n: int, k: int, rows: int, device: str | None = None) -> Config | None:
    """The config for an [N, K] weight and `rows` input rows (None: use cuBLAS). `device`: the
    CUDA device's name, whose tuned table (if any) comes first."""
    if rows > MAX_ROWS or rows < 1:
        return None
    # untuned shapes and devices: cuBLAS. The skinny kernels serve only where timing chose them.
    return TABLE.lookup((n, k), rows, device)[1]


def set_choice(n: int, k: int, rows: int, cfg: Config | None) -> None:
    """Pin the config for a shape's row class (the GPU check's tuning, or cuBLAS with None)."""
    TABLE.pin((n, k), rows, cfg)


def table_rows(device: str) -> dict[str, list[dict]]:
    """The pinned choices, in gemv_tuned.json's layout."""
    return TABLE.rows(device)


def tune(
    weight: torch.Tensor,
    rows: int,
    reps: int = 50,
    l2_bytes: int = 128 << 20,
) -> tuple[Config | None, float, float]:
    """(the fastest config, its µs, cuBLAS's µs) for `rows` input rows, timed on the device
    (each candidate's result checked against cuBLAS first). The calls of a timing cycle through
    copies of the weight that together exceed the L2 cache (`l2_bytes`), since the engine reads
    each weight once per step, from memory: timed on one copy, a 2-12 MB weight stays in the
    H200's 50 MB L2 and every kernel looks faster than it is."""
    nbytes = weight.numel() * weight.element_size()
    copies = [weight] + [weight.clone() for _ in range(max(0, -(-l2_bytes // nbytes) - 1))]
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    ref = torch.nn.functional.linear(x, weight)
    scale = ref.float().abs().max().item() + 1e-6

    def timed(fn: object) -> float:
        # replayed from a CUDA graph, as the engine runs decode: eager launches from Python
        # would take longer than these kernels
        for w in copies[:2]:
            fn(w)  # type: ignore[operator]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                fn(copies[i % len(copies)])  # type: ignore[operator]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    base = timed(lambda w: torch.nn.functional.linear(x, w))
    best: tuple[Config | None, float] = (None, base)
    for cfg in (c for c in CANDIDATES + DOT_CANDIDATES if fits(c, rows)):
        err = (gemv(x, weight, None, cfg).float() - ref.float()).abs().max().item() / scale
        if err > 2e-2:
            raise AssertionError(f"gemv {cfg} is off by {err:.3g} for {tuple(weight.shape)}")
        us = timed(lambda w, cfg=cfg: gemv(x, w, None, cfg))
        if us < best[1]:
            best = (cfg, us)
    copies.clear()  # the clones: up to 128 MB
    return best[0], best[1], base
