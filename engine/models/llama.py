"""The decoder-only transformer shared by Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

The model takes a flat batch: all of the step's tokens in one row, with their positions; the
attention backend and its per-step metadata are passed in, never read from a global. Under tensor
parallelism (engine.models.parallel) each rank builds the same model over its own heads, MLP
slice and vocabulary rows; `ShardLayout` gives the sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.kernels import fused_kernels, qkv_epilogue, wide_norm
from engine.models.parallel import (
    SINGLE,
    Linear,
    RowParallelLinear,
    ShardLayout,
    TPRank,
    VocabParallelEmbedding,
)
from engine.models.rope import RotaryEmbedding, StepRope

if TYPE_CHECKING:
    from engine.kvcache.pool import KVPool


class AttentionBackend(Protocol):
    """What a layer needs of its attention (engine.attention.base implements it): the model
    sits below the backends, which are chosen and built around it."""

    pool: KVPool

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int, meta: Any
    ) -> torch.Tensor: ...

    def new_token_slots(self, meta: Any) -> torch.Tensor | None: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dim of x: [T, dim], or [T, heads, dim] for per-head q/k norms."""
        fi = fused_kernels(x)
        if fi is not None and x.dtype == self.weight.dtype:
            return fi.rmsnorm(x, self.weight, self.eps)
        dtype = self.weight.dtype  # the compute type, also for a float32 residual stream
        wide = x.dtype != dtype
        if wide and (tk := wide_norm(x)) is not None:
            return tk.add_rmsnorm(None, x, self.weight, self.eps)
        x = x.float()
        # Hugging Face's ops in its order; the products are new tensors, so scaling them in
        # place (a product commutes exactly) saves allocations
        x = x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        if wide:  # from a float32 residual stream: scale in float32, round once
            return x.mul_(self.weight.float()).to(dtype)
        return x.to(dtype).mul_(self.weight)  # as Hugging Face rounds

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add and the next norm in one kernel
        on CUDA, which updates both tensors in place. A float32 residual stream stays float32;
        the norm comes out in the compute type."""
        fi = fused_kernels(x)
        if fi is not None and residual.dtype == x.dtype:
            fi.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        if (tk := wide_norm(residual)) is not None:  # in place, as the fused kernel above
            return tk.add_rmsnorm(x, residual, self.weight, self.eps), residual
        if x.dtype == residual.dtype:  # into x, this layer's new output (the sum commutes)
            residual = x.add_(residual)
        else:  # a float32 residual stream: the sum in float32
            residual = x + residual
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, shard: ShardLayout, tp: TPRank) -> None:
        super().__init__()
        self.layer_id = layer_id
        # this rank's heads: all of them on one device
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shard.heads.q_heads,
            shard.heads.kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: StepRope,
        backend: AttentionBackend,
        meta: Any,
    ) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), positions, rope, backend, meta)

    def attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: StepRope,
        backend: AttentionBackend,
        meta: Any,
    ) -> torch.Tensor:
        """The layer's attention output from its q/k/v projection (o_proj applied)."""
        n = qkv.shape[0]
        slots = backend.new_token_slots(meta)
        ep = qkv_epilogue(qkv, self.head_dim) if slots is not None else None
        if ep is not None and rope.cos_sin is not None:
            # norms, RoPE and the K/V store in one kernel; the backend only attends
            qn, kn = self.q_norm, self.k_norm
            q = ep.qkv_epilogue(
                qkv,
                positions,
                rope.cos_sin,
                qn.weight if qn is not None else None,
                kn.weight if kn is not None else None,
                qn.eps if qn is not None else 0.0,
                backend.pool.k[self.layer_id],
                backend.pool.v[self.layer_id],
                slots,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )
            out = backend.forward(q, None, None, self.layer_id, meta)
            return self.o_proj(out.reshape(n, -1))
        q, k, v = qkv.split(self.split, dim=-1)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is None and not rope.fused(qkv):
            # q and k lie side by side in qkv: one rotation for both heads' sets
            qk = qkv[:, : self.split[0] + self.split[1]].view(n, -1, self.head_dim)
            qk = rope.rotate(qk)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope(q, k)  # on CUDA in place, into qkv's storage or the norms' output
        out = backend.forward(q, k, v, self.layer_id, meta)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardLayout, tp: TPRank) -> None:
        super().__init__()
        inter = shard.inter_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fi = fused_kernels(gate_up)
        if fi is not None:
            return self.down_proj(fi.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate).mul_(up))  # silu's output is new


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, shard: ShardLayout, tp: TPRank) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, shard, tp)
        self.mlp = MLP(cfg, shard, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor | None,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: StepRope,
        backend: AttentionBackend,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller adds the two,
        fused into the next norm. The first layer gets the embeddings as `h` (no residual yet),
        or, for a float32 residual stream, already as `residual` (and no `h`)."""
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        # a few decode rows on CUDA: each norm runs inside the GEMV of the projection after it
        # (not for a float32 residual stream: the GEMV rounds the new stream to its own dtype)
        fold = attn.qkv_proj.folded(h) if h is not None else None
        if fold is not None and h is not None and (residual is None or residual.dtype == h.dtype):
            g, cfg = fold
            delta, stream = (None, h) if residual is None else (h, residual)
            qkv, residual = g.norm_gemv(
                delta,
                stream,
                ln1.weight,
                ln1.eps,
                attn.qkv_proj.weight,
                attn.qkv_proj.bias,
                cfg,
            )
            x = attn.attend(qkv, positions, rope, backend, meta)
        else:
            if h is None:
                assert residual is not None
                x = ln1(residual)
            elif residual is None:
                residual, x = h, ln1(h)
            else:
                x, residual = ln1.add_forward(h, residual)
            x = attn(x, positions, rope, backend, meta)
        assert residual is not None
        fold = mlp.gate_up_proj.folded(x) if residual.dtype == x.dtype else None
        if fold is not None and mlp.gate_up_proj.bias is None:
            g, cfg = fold
            act, residual = g.norm_gemv(
                x, residual, ln2.weight, ln2.eps, mlp.gate_up_proj.weight, None, cfg, act=True
            )
            return mlp.down_proj(act), residual
        x, residual = ln2.add_forward(x, residual)
        return mlp(x), residual


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardLayout, tp: TPRank) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            shard.vocab_rows, cfg.hidden_size, shard.vocab_start, tp
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Hidden states for a flat batch, and logits only for the rows that will be sampled."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPRank = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.shard = ShardLayout.of(cfg, tp)
        # the heads this rank attends with: its KV pool and attention backend are sized by them
        self.num_heads, self.num_kv_heads = self.shard.heads.q_heads, self.shard.heads.kv_heads
        self.model = DecoderBody(cfg, self.shard, tp)
        self.lm_head = Linear(cfg.hidden_size, self.shard.vocab_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # None: the residual stream is kept in the compute type, as Hugging Face does. float32
        # keeps it wider: each layer's add then rounds once less, at the price of unfused norms.
        self.residual_dtype: torch.dtype | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: Any,
    ) -> torch.Tensor:
        h: torch.Tensor | None = self.model.embed_tokens(input_ids)
        residual = None
        if self.residual_dtype is not None and h is not None and h.dtype != self.residual_dtype:
            residual, h = h.to(self.residual_dtype), None
        rope = self.rope.at(positions)
        for layer in self.model.layers:
            h, residual = layer(h, residual, positions, rope, backend, meta)
        if h is None or residual is None:  # no layers
            return self.model.norm(residual if h is None else h)
        return self.model.norm.add_forward(h, residual)[0]

    def prepack(self) -> None:
        """Reorder every projection's weight for the CPU matmul (Linear.prepack), once the
        weights are loaded."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.prepack()

    def set_batch_invariant(self, on: bool) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.batch_invariant = on

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of every row of `hidden`; under tensor parallelism each rank computes its
        vocabulary rows and rank 0 gathers them (the other ranks get None: they never sample)."""
        out = self.lm_head(hidden)
        if self.tp.size == 1:
            return out
        parts = self.tp.gather_first(out)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.config.vocab_size]
