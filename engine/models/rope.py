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
        fi = fused_kernels(q)
        if fi is not None and self.cos_sin is not None:
            # in place, one kernel for q and k; strided views (of the qkv output) are fine
            fi.apply_rope_with_cos_sin_cache_inplace(
                positions, q, k, q.shape[-1], self.cos_sin, is_neox=True
            )
            return q, k
        # the table is float32, cast like HF does
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
