"""Rotary position embedding: a cos/sin table indexed by position, applied as Hugging Face does."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.models.kernels import fused_kernels


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        # FlashInfer's layout, [positions, cos half | sin half]; a plain attribute, not a
        # buffer, so that casting the model to bf16 leaves it float32 as the kernel requires
        self.cos_sin: torch.Tensor | None = None
        # built on the meta device, the model gets its table after `to_empty` (build_model); meta
        # arithmetic here would only import torch._dynamo (about 1 s of every engine start)
        if self.cos.device.type != "meta":
            self.build_table(self.cos.device)

    def build_table(self, device: torch.device) -> None:
        """(Re)compute the table, e.g. after the model was built on the meta device."""
        head_dim, max_positions, theta, scaling = self.args
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions).float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)
        self.cos_sin = None
        if device.type == "cuda":
            self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hk, D]
        return self.at(positions)(q, k)

    def at(self, positions: torch.Tensor) -> StepRope:
        """The embedding at one step's positions, for all of the step's layers."""
        return StepRope(self, positions)


class StepRope:
    """The rotary embedding at one step's positions, shared by every layer of the step: the
    table rows are gathered once (by the first layer that needs them), not once per layer."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rope, self.positions = rope, positions
        self.cos_sin = rope.cos_sin  # the fused CUDA kernel's table (None elsewhere)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def fused(self, q: torch.Tensor) -> bool:
        """Whether q and k are rotated in place by FlashInfer's kernel."""
        return self.cos_sin is not None and fused_kernels(q) is not None

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fi = fused_kernels(q)
        if fi is not None and self.cos_sin is not None:
            # in place, one kernel for q and k; strided views (of the qkv output) are fine
            fi.apply_rope_with_cos_sin_cache_inplace(
                self.positions, q, k, q.shape[-1], self.cos_sin, is_neox=True
            )
            return q, k
        return self.rotate(q), self.rotate(k)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated as Hugging Face does, x * cos + rotate_half(x) * sin, bit for
        bit: rotate_half(x) = [-x2, x1] is roll(x, D/2) times [-1 | 1], and the sign is folded
        into the sin table (negating a factor of a product is exact). Two passes fewer."""
        cos, signed_sin = self._at(x.dtype)
        return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin

    def _at(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0].dtype != dtype:
            # the table is float32, cast like HF does
            cos = self.rope.cos.index_select(0, self.positions).to(dtype)
            sin = self.rope.sin.index_select(0, self.positions).to(dtype)
            half = sin.shape[-1] // 2
            signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            self._tables = (cos.unsqueeze(1), signed.unsqueeze(1))
        return self._tables
