"""Tiny random-weight Hugging Face models, saved as real model directories.

Weights are drawn with a large spread so that greedy choices have clear margins: exactness checks
then compare token ids, not luck in near-ties.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TINY_COMMON = dict(
    vocab_size=49152,  # the bundled SmolLM2 tokenizer's vocabulary
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


# per architecture: the HF classes' names, and the tiny defaults that differ between them
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"head_dim": 16, "rope_theta": 10000.0}),
    "qwen2": ("Qwen2", {"rope_theta": 1000000.0}),  # bias on q, k and v
    "qwen3": ("Qwen3", {"head_dim": 32, "rope_theta": 1000000.0}),
}


def make_tiny(
    kind: str,
    path: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    proj_std: float = 0.15,
    **shape: Any,
) -> Path:
    """A random HF model directory with the bundled tokenizer. `shape` overrides config fields
    (the GPU tests use FlashInfer-sized heads); `proj_std` is the spread of the projections."""
    import transformers

    if kind not in ARCHS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(ARCHS)}")
    prefix, defaults = ARCHS[kind]
    cfg = getattr(transformers, f"{prefix}Config")(**{**TINY_COMMON, **defaults, **shape})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else proj_std)
    model.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


def make_wide_model(
    path: Path,
    tokenizer_dir: Path,
    *,
    arch: str = "qwen3",
    num_layers: int = 2,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 128,
    seed: int = 0,
) -> Path:
    """A random Hugging Face model directory with FlashInfer-sized heads and the bundled
    tokenizer's 49,152-token vocabulary. Embeddings spread widely (clear greedy margins); the
    projections keep activations at scale, so bf16 rounding is not amplified layer by layer."""
    return make_tiny(
        arch,
        path,
        tokenizer_dir,
        seed=seed,
        proj_std=0.03,
        hidden_size=num_heads * head_dim,
        intermediate_size=1024,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
    )
