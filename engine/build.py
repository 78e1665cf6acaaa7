"""Building an engine from its config: the model, tokenizer, KV pool, page table, prefix cache,
scheduler, attention backend and runner, with every default the config leaves open (max_seq_len,
num_pages) resolved against the model and the device's memory."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.registry import create_backend
from engine.config import EngineConfig, EngineInfo
from engine.kvcache.manager import KVManager, pages_for
from engine.kvcache.naive import NaiveCache
from engine.kvcache.pool import KVPool
from engine.kvcache.prefix import PrefixCache
from engine.kvcache.radix import RadixCache
from engine.kvcache.table import PageTable
from engine.models.config import ModelConfig
from engine.models.loader import build_model, load_tokenizer, read_config, resolve
from engine.models.parallel import SINGLE
from engine.runner import ModelRunner
from engine.scheduler.admission import NewTokenRatio
from engine.scheduler.scheduler import Scheduler
from instrumentation.errors import InvalidRequest

if TYPE_CHECKING:
    from engine.distributed import Leader

CPU_KV_BYTES = 1 << 30  # default KV budget on CPU; on CUDA most of the free memory
CUDA_KV_FRACTION = 0.8  # of the free memory after the weights are loaded
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EngineParts:
    """A built engine: `config` has every default resolved (no None, no "auto" device)."""

    config: EngineConfig
    info: EngineInfo
    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig
    tokenizer: Any
    model: Any
    pool: KVPool
    table: PageTable
    kv: KVManager
    scheduler: Scheduler
    runner: ModelRunner
    leader: Leader | None
    eos_token_ids: frozenset[int]


def check_triton(cfg: EngineConfig) -> None:
    """The Triton kernels' absence is said before the slow model load, not after it."""
    if cfg.attention_backend != "triton":
        return
    from engine.kernels import triton_unavailable

    if (reason := triton_unavailable(cfg.device)) is not None:
        what = "batch_invariant" if cfg.batch_invariant else "the triton attention backend"
        raise InvalidRequest(f"{what} needs the Triton kernels: {reason}")


def build_engine(config: EngineConfig, progress: bool = True) -> EngineParts:
    cfg = config.resolve(torch.cuda.is_available())
    check_triton(cfg)
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]  # type: ignore[index]
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        # A CUDA engine's CPU tensors are tiny (plans, indices): a pool of one OpenMP worker per
        # core only spins, and stalls the step whenever a core is taken by the API process or a
        # client (measured on the H200: +17% step time with 8 WebSocket clients). vLLM does alike.
        torch.set_num_threads(1)
    page_size: int = cfg.page_size  # type: ignore[assignment]

    resolved = resolve(cfg.model, progress=progress)
    mcfg, _ = read_config(resolved.path)
    tokenizer = load_tokenizer(resolved.path, progress=progress)
    cfg = replace(cfg, max_seq_len=cfg.max_seq_len or min(mcfg.max_position_embeddings, 8192))
    max_seq_len: int = cfg.max_seq_len  # type: ignore[assignment]
    torch.manual_seed(cfg.seed)
    # tensor parallelism: the other ranks load their shards while this one loads its own
    leader = start_ranks(cfg, resolved.path, mcfg, device)
    model = build_model(
        resolved.path,
        mcfg,
        max_seq_len + page_size,
        dtype,
        device,
        load_format=cfg.load_format,  # type: ignore[arg-type]
        progress=progress,
        seed=cfg.seed,
        tp=SINGLE if leader is None else leader.tp,
    )
    if cfg.residual_dtype is not None:
        model.residual_dtype = DTYPES[cfg.residual_dtype]
    model.set_batch_invariant(cfg.batch_invariant)
    cfg = replace(cfg, num_pages=cfg.num_pages or default_num_pages(cfg, mcfg, model, dtype))
    num_pages: int = cfg.num_pages  # type: ignore[assignment]
    if leader is not None:
        leader.connect(num_pages)

    # one spare page past the allocator's range: CUDA-graph padding rows write their KV there
    pool = KVPool(
        mcfg.num_layers,
        num_pages + 1,
        page_size,
        model.num_kv_heads,  # this rank's share under tensor parallelism
        mcfg.head_dim,
        dtype,
        device,
    )
    table = PageTable(cfg.max_running_req, max_seq_len, page_size)
    cache: PrefixCache = (
        RadixCache(page_size) if cfg.cache_type == "radix" else NaiveCache(page_size)
    )
    kv = KVManager(num_pages, page_size, table, cache)
    backend = create_backend(
        cfg.attention_backend, device, pool, model.num_heads, model.num_kv_heads, mcfg.head_dim
    )
    runner = ModelRunner(
        model,
        pool,
        table,
        backend,
        device,
        cuda_graph=cfg.cuda_graph,
        pad_page=num_pages,
        leader=leader,
    )
    eos = set(mcfg.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    info = EngineInfo(
        model=resolved.name,
        device=str(device),
        dtype=cfg.dtype,  # type: ignore[arg-type]
        vocab_size=mcfg.vocab_size,
        page_size=page_size,
        num_pages=num_pages,
        max_running_req=cfg.max_running_req,
        max_seq_len=max_seq_len,
        cache_type=cfg.cache_type,
        attention_backend=backend.name,
        architecture=mcfg.architecture,
        overlap=bool(cfg.overlap),
        residual_dtype=cfg.residual_dtype or cfg.dtype,  # type: ignore[arg-type]
        batch_invariant=cfg.batch_invariant,
        tp_size=cfg.tp_size,
    )
    ratio = NewTokenRatio.scaled(cfg.schedule_conservativeness, cfg.new_token_ratio_decay_steps)
    scheduler = Scheduler(kv, ratio)
    return EngineParts(
        cfg, info, device, dtype, mcfg, tokenizer, model, pool, table, kv, scheduler, runner,
        leader, frozenset(eos),
    )  # fmt: skip


def default_num_pages(cfg: EngineConfig, mcfg: ModelConfig, model: Any, dtype: torch.dtype) -> int:
    """Pages for a memory budget (1 GiB on CPU, most of the free memory on CUDA), at most what
    max_running_req full-length requests need, and at least one full-length request."""
    page_size, max_seq_len = cfg.page_size or 1, cfg.max_seq_len or 1
    # this rank's KV heads: under tensor parallelism rank 0 holds the most
    per_token = KVPool.bytes_per_token(mcfg.num_layers, model.num_kv_heads, mcfg.head_dim, dtype)
    if cfg.device == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device("cuda"))
        budget = int(free * CUDA_KV_FRACTION)
    else:
        budget = CPU_KV_BYTES
    tokens = min(budget // per_token, cfg.max_running_req * max_seq_len)
    return max(tokens // page_size, pages_for(max_seq_len, page_size))


def start_ranks(
    cfg: EngineConfig, path: Path, mcfg: ModelConfig, device: torch.device
) -> Leader | None:
    """With tp_size > 1, start the worker ranks (engine.distributed); None otherwise."""
    if cfg.tp_size == 1:
        return None
    from engine.distributed import start_leader

    page_size, max_seq_len = cfg.page_size or 1, cfg.max_seq_len or 1
    return start_leader(
        model_path=path, mcfg=mcfg, device=device, dtype=cfg.dtype,
        max_positions=max_seq_len + page_size, load_format=cfg.load_format,
        seed=cfg.seed, residual_dtype=cfg.residual_dtype, page_size=page_size,
        max_running_req=cfg.max_running_req, max_seq_len=max_seq_len,
        attention=cfg.attention_backend, cuda_graph=cfg.cuda_graph, overlap=cfg.overlap,
        tp_size=cfg.tp_size,
    )  # fmt: skip
