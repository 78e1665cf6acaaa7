"""Engine configuration: fixed at start (`EngineConfig`) and live (`LiveConfig`, changed any time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from instrumentation.errors import InvalidRequest
from instrumentation.records import ADMISSION_MODES

POLICY_NAMES = ("prefill_first", "mixed")
CACHE_TYPES = ("radix", "naive")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer", "triton")
Device = Literal["cpu", "cuda", "auto"]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_budget(v: object) -> int:
    if not _is_int(v) or v < 1:  # type: ignore[operator]
        raise InvalidRequest(f"max_extend_tokens must be an integer >= 1, got {v!r}")
    return v  # type: ignore[return-value]


def check_policy(v: object) -> str:
    if v not in POLICY_NAMES:
        raise InvalidRequest(f"unknown policy {v!r}; expected one of {', '.join(POLICY_NAMES)}")
    return v  # type: ignore[return-value]


def check_admission(v: object) -> str:
    if v not in ADMISSION_MODES:
        raise InvalidRequest(
            f"unknown admission {v!r}; expected one of {', '.join(ADMISSION_MODES)}"
        )
    return v  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """What a user may change while the engine runs; every step reads one snapshot."""

    max_extend_tokens: int
    policy: str
    admission: str = "reserve"

    def __post_init__(self) -> None:
        check_budget(self.max_extend_tokens)
        check_policy(self.policy)
        check_admission(self.admission)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"
    device: Device = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    page_size: int | None = None  # None: 16 on CUDA (fewer, larger allocations), 1 on CPU
    cache_type: str = "radix"
    max_running_req: int = 32
    num_pages: int | None = None  # None: sized from a memory budget (see LLM)
    max_seq_len: int | None = None  # None: the model's context, at most 8192
    attention_backend: str = "auto"  # auto | torch | flashinfer | triton
    cuda_graph: bool = True
    overlap: bool | None = None  # schedule step N+1 while N runs; None: on for CUDA
    residual_dtype: str | None = None  # None: the compute dtype; "float32": a wider stream
    # Triton matmul and attention whose rows do not depend on the batch: a request's tokens
    # are then the same alone or batched, chunked or whole (needs Triton, on CUDA)
    batch_invariant: bool = False
    load_format: Literal["auto", "dummy"] = "auto"
    seed: int = 0
    # ranks the model is split over (tensor parallelism, engine.distributed): one process and,
    # on CUDA, one GPU each; the heads are dealt out by whole GQA groups, unevenly if need be
    tp_size: int = 1
    # optimistic admission (engine.scheduler.admission), SGLang's knobs: the estimate of
    # future outputs starts at 0.7 x conservativeness and decays over this many steps
    schedule_conservativeness: float = 1.0
    new_token_ratio_decay_steps: int = 600

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda", "auto"):
            raise InvalidRequest(f"device must be cpu, cuda or auto, got {self.device!r}")
        if not _is_int(self.max_running_req) or self.max_running_req < 1:
            raise InvalidRequest(
                f"max_running_req must be an integer >= 1, got {self.max_running_req!r}"
            )
        for name in ("page_size", "num_pages", "max_seq_len"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise InvalidRequest(f"{name} must be an integer >= 1 or None, got {v!r}")
        if self.cache_type not in CACHE_TYPES:
            raise InvalidRequest(
                f"cache_type must be one of {CACHE_TYPES}, got {self.cache_type!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequest(
                f"unknown attention backend {self.attention_backend!r}; expected one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        for name in ("cuda_graph", "overlap", "batch_invariant"):
            v = getattr(self, name)
            if not isinstance(v, bool) and not (name == "overlap" and v is None):
                raise InvalidRequest(f"{name} must be a bool, got {v!r}")
        if self.batch_invariant and self.attention_backend not in ("auto", "triton"):
            raise InvalidRequest(
                f"batch_invariant runs the triton attention backend, not {self.attention_backend!r}"
            )
        if self.residual_dtype not in (None, "float32"):
            raise InvalidRequest(
                f"residual_dtype must be None or float32, got {self.residual_dtype!r}"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise InvalidRequest(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not _is_int(self.tp_size) or self.tp_size < 1:
            raise InvalidRequest(f"tp_size must be an integer >= 1, got {self.tp_size!r}")
        c = self.schedule_conservativeness
        if isinstance(c, bool) or not isinstance(c, int | float) or not 0 < c < float("inf"):
            raise InvalidRequest(f"schedule_conservativeness must be a number > 0, got {c!r}")
        d = self.new_token_ratio_decay_steps
        if not _is_int(d) or d < 1:
            raise InvalidRequest(f"new_token_ratio_decay_steps must be an integer >= 1, got {d!r}")
        if self.tp_size > 1 and self.batch_invariant:
            # an all-reduce's summation order depends on the message size (NCCL picks its
            # algorithm by size), so a row's sum would depend on the batch again
            raise InvalidRequest("batch_invariant needs tp_size=1: all-reduce sums are not")
