"""Tensor parallelism for the model: which part of every weight a rank holds, and the layers that
turn those parts back into whole activations.

Megatron's split, as in vLLM, SGLang and mini-sglang: QKV and gate-up are column-parallel (each
rank computes its own heads and its own slice of the MLP, no communication); O and down are
row-parallel (each rank's partial product is summed with one all-reduce); the embedding and the
LM head are split by vocabulary rows (the embedding's rows are summed, the logits gathered on
rank 0, which alone samples).

Heads are dealt out by whole GQA groups, so every rank's attention is an ordinary GQA attention
over its own KV heads. When the KV heads do not divide evenly, the first ranks get one more group
(SmolLM2's 3 KV heads on 2 ranks: 2 and 1); when there are fewer KV heads than ranks, each KV
head is replicated on `size / kv_heads` ranks and its query heads are split between them, as
SGLang does. The sums are the same either way, so uneven splits cost balance, not correctness.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.kernels import (
    device_name,
    folded_gemv,
    invariant_linear,
    onednn_linear,
    onednn_weight,
    skinny_gemv,
)


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of `rank`'s share when n items are dealt to `size` ranks as evenly as
    possible, the first ranks taking one extra."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


class TPRank:
    """This process's place in the tensor-parallel group and the two collectives the model runs.
    `size == 1` is the single-device engine: no collectives at all. With `timed` (CPU only: on
    CUDA the calls are queued, and some are captured into graphs) the wall time spent in
    collectives is added up in `comm_s`, which the runner reads and resets every step."""

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None, timed: bool = False):
        self.rank, self.size, self.group, self.timed = rank, size, group, timed
        self.comm_s = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = time.perf_counter() if self.timed else 0.0
        dist.all_reduce(x, group=self.group)
        if self.timed:
            self.comm_s += time.perf_counter() - t
        return x

    def gather_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape everywhere) on rank 0, in rank order; None elsewhere."""
        import torch.distributed as dist

        t = time.perf_counter() if self.timed else 0.0
        out = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), out, dst=self._global(0), group=self.group)
        if self.timed:
            self.comm_s += time.perf_counter() - t
        return out

    def _global(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)


SINGLE = TPRank()


@dataclass(frozen=True, slots=True)
class HeadShard:
    """A rank's query heads [q_start, q_start + q_heads) and KV heads [kv_start, ...)."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Deal whole GQA groups to ranks; below one KV head per rank, replicate KV heads (see the
    module docstring). Raises ValueError for a split that leaves a rank without heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv = split(num_kv_heads, size, rank)
        return HeadShard(kv_start * group, kv * group, kv_start, kv)
    if size % num_kv_heads:
        raise ValueError(
            f"tp_size={size} must divide or be a multiple of the {num_kv_heads} KV heads "
            "(each KV head is then replicated on tp_size / KV heads ranks)"
        )
    replicas = size // num_kv_heads
    if group < replicas:
        raise ValueError(
            f"tp_size={size} would leave ranks without query heads: {num_heads} query heads "
            f"for {num_kv_heads} KV heads give each KV head's {replicas} replicas {group} heads"
        )
    kv = rank // replicas
    q_off, q = split(group, replicas, rank % replicas)
    return HeadShard(kv * group + q_off, q, kv, 1)


@dataclass(frozen=True, slots=True)
class Sections:
    """Where a rank's part of a parameter lies in the whole (tp_size=1) tensor: along `dim`,
    whose whole length is `full`, the rank keeps `ranges`, concatenated in this order."""

    dim: int
    full: int
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The sizes of one rank's model: the model reads its local shapes here, the loader its
    slices (`sections`), so the two cannot disagree."""

    cfg: ModelConfig
    heads: HeadShard
    inter_start: int
    inter_size: int
    vocab_start: int
    vocab_rows: int  # rows of the rank's embedding and LM head: ceil(vocab / size) everywhere

    @classmethod
    def of(cls, cfg: ModelConfig, tp: TPRank) -> ShardLayout:
        heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
        inter_start, inter_size = split(cfg.intermediate_size, tp.size, tp.rank)
        # equal row counts on every rank, so the logits gather needs no per-rank shapes; the
        # last rank's rows past the vocabulary are zero and cut off after the gather
        rows = -(-cfg.vocab_size // tp.size)
        return cls(cfg, heads, inter_start, inter_size, tp.rank * rows, rows)

    def sections(self, name: str) -> Sections | None:
        """This rank's part of parameter `name` (a CausalLM parameter name); None: replicated."""
        c, h, d = self.cfg, self.heads, self.cfg.head_dim
        q, kv = c.num_heads * d, c.num_kv_heads * d
        k0, k1 = h.kv_start * d, (h.kv_start + h.kv_heads) * d
        q_rows = (h.q_start * d, (h.q_start + h.q_heads) * d)
        inter = (self.inter_start, self.inter_start + self.inter_size)
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            return Sections(0, q + 2 * kv, (q_rows, (q + k0, q + k1), (q + kv + k0, q + kv + k1)))
        if name.endswith("o_proj.weight"):
            return Sections(1, q, (q_rows,))
        if name.endswith("gate_up_proj.weight"):
            full = c.intermediate_size
            return Sections(0, 2 * full, (inter, (full + inter[0], full + inter[1])))
        if name.endswith("down_proj.weight"):
            return Sections(1, c.intermediate_size, (inter,))
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            end = min(self.vocab_start + self.vocab_rows, c.vocab_size)
            return Sections(0, c.vocab_size, ((self.vocab_start, end),))
        return None


def take(full: torch.Tensor, s: Sections) -> torch.Tensor:
    """The rank's part of a whole tensor: its sections, concatenated along s.dim."""
    parts = [full.narrow(s.dim, a, b - a) for a, b in s.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=s.dim)


def copy_part(dst: torch.Tensor, part: torch.Tensor, offset: int, s: Sections) -> int:
    """Copy the overlap of `part` (rows [offset, offset + len) of the whole tensor along s.dim,
    e.g. k_proj inside the fused QKV) with the rank's sections into `dst`, the rank's local
    tensor. Returns how many elements along s.dim it filled."""
    n = part.shape[s.dim]
    local, filled = 0, 0
    for a, b in s.ranges:
        lo, hi = max(a, offset), min(b, offset + n)
        if lo < hi:
            dst.narrow(s.dim, local + lo - a, hi - lo).copy_(
                part.narrow(s.dim, lo - offset, hi - lo)
            )
            filled += hi - lo
        local += b - a
    return filled


class Linear(nn.Linear):
    """nn.Linear whose matmul is the batch-invariant Triton kernel when `batch_invariant` is set
    (CausalLM.set_batch_invariant): each row's result then ignores how many rows came with it.
    Column-parallel layers are plain Linears over the rank's output rows. On CPU, `prepack`
    reorders the weight once for oneDNN's matmul (engine.models.kernels.onednn_weight)."""

    batch_invariant = False
    packed: torch.Tensor | None = None  # the weight in oneDNN's layout (CPU, float32)
    packed_version = -1  # the weight's version counter when `packed` was made

    def prepack(self) -> None:
        """Reorder the loaded weight for oneDNN when it runs there."""
        self.packed = onednn_weight(self.weight)
        self.packed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_linear()(x, self.weight, self.bias)
        if self.packed is not None:
            if self.weight._version != self.packed_version:
                # written in place since (load_state_dict, a test's copy_): reorder it again,
                # or the matmul would use the old values
                self.prepack()
            if (
                self.packed is not None
                and (y := onednn_linear(x, self.packed, self.bias)) is not None
            ):
                return y
        if (g := skinny_gemv(x)) is not None:  # a few rows on CUDA: decode at small batch
            n, k = self.weight.shape
            cfg = g.choose(n, k, x.numel() // k, device_name(x.device))
            if cfg is not None:
                return g.gemv(x, self.weight, self.bias, cfg)
        return super().forward(x)

    def folded(self, x: torch.Tensor) -> tuple[ModuleType, Any] | None:
        """(engine.kernels.gemv, config) when the residual add and RMSNorm before this
        projection of x's few rows can run inside its GEMV, else None."""
        if self.batch_invariant or (g := folded_gemv(x)) is None:
            return None
        n, k = self.weight.shape
        rows = x.numel() // k
        if rows > g.GEMV_ROWS or x.dtype != self.weight.dtype:
            return None
        cfg = g.choose(n, k, rows, device_name(x.device))
        return (g, cfg) if g.foldable(cfg) else None


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features: the partial products of all ranks
    are summed in place with one all-reduce. No bias: it would be added once per rank."""

    def __init__(self, in_features: int, out_features: int, tp: TPRank) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [start, start + rows) of the vocabulary. A token outside them gives
    zeros here and its row on the rank that holds it; the all-reduce adds the one real row to
    zeros, so the result is exact."""

    def __init__(self, num_rows: int, dim: int, start: int, tp: TPRank) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, dim))
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)
