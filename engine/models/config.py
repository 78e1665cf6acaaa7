"""ModelConfig: the few facts of a Hugging Face config.json the engine's model needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Hugging Face architecture name -> (q/k per-head RMSNorm, bias on q/k/v)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (False, True),
    "Qwen3ForCausalLM": (True, False),
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None and not archs:
            arch = MODEL_TYPES.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs!r}; supported: {sorted(ARCHITECTURES)}"
            )
        qk_norm, qkv_bias = ARCHITECTURES[arch]
        qkv_bias = bool(cfg.get("attention_bias", qkv_bias))
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        # transformers 5 nests rope settings in rope_parameters; 4.x keeps them at the top level
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            qkv_bias=qkv_bias,
            eos_token_ids=eos_ids,
        )
