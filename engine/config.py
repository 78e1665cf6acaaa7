"""Engine settings, each written once: its default, help text and validation.

`EngineConfig` is the one list of what the engine can be started with. `LLM(...)`'s keyword
arguments and the server's command line (`python -m engine.server --help`) are both generated
from its fields: a field's metadata carries its help text and choices, and `add_arguments` turns
any such dataclass into argparse options. `LiveConfig` is the part a user may change while the
engine runs (the budget and the policy); `EngineConfig` holds their starting values.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, TypeVar

from instrumentation.errors import InvalidRequest
from instrumentation.protocol import ADMISSION_MODES, CACHE_TYPES, POLICY_NAMES

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer", "triton")
DEVICES = ("cpu", "cuda", "auto")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
Device = Literal["cpu", "cuda", "auto"]
C = TypeVar("C")


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    noun: str | None = None,
    minimum: int = 1,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that is also a command-line option. `choices` are validated and
    offered by argparse; `noun` names the setting in the error for a value outside them;
    integer fields must be >= `minimum`; `parse` replaces argparse's type conversion."""
    meta = {"help": help, "choices": choices, "noun": noun, "minimum": minimum, "parse": parse,
            "metavar": metavar}  # fmt: skip
    if isinstance(default, list | dict | set):
        raise TypeError("a setting's default must be immutable (use a tuple)")
    return field(default=default, metadata=meta)


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


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed) of a field's annotation."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def validate_fields(obj: Any) -> None:
    """Check every setting of a dataclass against its annotation and metadata."""
    hints = _hints(type(obj))
    for f in fields(obj):
        if "help" not in f.metadata:
            continue
        v = getattr(obj, f.name)
        base, optional = _base_type(hints[f.name])
        if v is None and optional:
            continue
        meta = f.metadata
        if meta["choices"] is not None and v not in meta["choices"]:
            raise InvalidRequest(
                f"unknown {meta['noun'] or f.name} {v!r}; expected one of "
                f"{', '.join(map(str, meta['choices']))}"
            )
        if base is bool and not isinstance(v, bool):
            raise InvalidRequest(f"{f.name} must be a bool, got {v!r}")
        if base is int and (not _is_int(v) or v < meta["minimum"]):
            none = " or None" if optional else ""
            raise InvalidRequest(
                f"{f.name} must be an integer >= {meta['minimum']}{none}, got {v!r}"
            )
        if base is str and not isinstance(v, str):
            raise InvalidRequest(f"{f.name} must be a string, got {v!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is started with. `None` means "chosen for the device or model":
    `resolve` fills what the device decides, the model load (engine.build) the rest."""

    model: str = setting("smollm2", "'smollm2' or a local Hugging Face directory")
    device: Device = setting("cpu", "where the model runs; auto: CUDA if present", choices=DEVICES)
    dtype: str | None = setting(
        None, "compute dtype (default: float32 on CPU, bfloat16 on CUDA)", choices=DTYPE_NAMES
    )
    max_extend_tokens: int = setting(256, "prompt tokens per step (the budget; live)")
    policy: str = setting(
        "prefill_first", "the scheduling policy (live)", choices=POLICY_NAMES, noun="policy"
    )
    admission: str = setting(
        "reserve",
        "reserve: promise every page a request may need; optimistic: estimate its outputs "
        "(SGLang's new_token_ratio) and retract running requests when decode runs short (live)",
        choices=ADMISSION_MODES,
        noun="admission",
    )
    schedule_conservativeness: float = setting(
        1.0,
        "optimistic admission: scales the estimate of future outputs (SGLang's)",
        parse=float,
    )
    new_token_ratio_decay_steps: int = setting(
        600, "optimistic admission: steps over which the estimate decays to its floor"
    )
    page_size: int | None = setting(
        None, "tokens per KV page (default: 16 on CUDA, for fewer and larger pages; 1 on CPU)"
    )
    cache_type: str = setting("radix", "prefix cache: radix tree or none", choices=CACHE_TYPES)
    max_running_req: int = setting(32, "requests decoding at once (page-table rows)")
    num_pages: int | None = setting(
        None, "KV pages (default: sized from 1 GiB on CPU, 80%% of free memory on CUDA)"
    )
    max_seq_len: int | None = setting(
        None, "longest request, prompt and output (default: the model's context, at most 8192)"
    )
    attention_backend: str = setting(
        "auto", "attention kernels", choices=ATTENTION_BACKENDS, noun="attention backend"
    )
    cuda_graph: bool = setting(True, "replay decode steps from captured CUDA graphs")
    overlap: bool | None = setting(
        None, "schedule the next step while the device runs this one (default: on CUDA)"
    )
    residual_dtype: str | None = setting(
        None, "keep the residual stream in float32 (default: the compute dtype)",
        choices=("float32",),
    )  # fmt: skip
    # the same tokens for a request alone or batched, chunked or whole
    batch_invariant: bool = setting(
        False,
        "Triton kernels whose rows ignore the batch: the same tokens alone or batched, "
        "chunked or whole (needs Triton)",
    )
    load_format: str = setting(
        "auto", "dummy: random weights from the model's config.json (its shape, no weights)",
        choices=LOAD_FORMATS,
    )  # fmt: skip
    seed: int = setting(0, "seed for the weights of --load-format dummy and sampling", minimum=0)
    # the heads are dealt out by whole GQA groups, unevenly if need be (engine.distributed)
    tp_size: int = setting(
        1, "split the model over this many ranks (processes; GPUs cuda:0.. on CUDA)"
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.batch_invariant and self.attention_backend not in ("auto", "triton"):
            raise InvalidRequest(
                f"batch_invariant runs the triton attention backend, not {self.attention_backend!r}"
            )
        c = self.schedule_conservativeness
        if isinstance(c, bool) or not isinstance(c, int | float) or not 0 < c < float("inf"):
            raise InvalidRequest(f"schedule_conservativeness must be a number > 0, got {c!r}")
        if self.tp_size > 1 and self.batch_invariant:
            # an all-reduce's summation order depends on the message size (NCCL picks its
            # algorithm by size), so a row's sum would depend on the batch again
            raise InvalidRequest("batch_invariant needs tp_size=1: all-reduce sums are not")

    @classmethod
    def of(cls: type[C], what: str = "LLM()", **settings: Any) -> C:
        """From keyword arguments, refusing a name that is not a setting (a typo must not
        silently start an engine with a default)."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if unknown := sorted(set(settings) - names):
            raise TypeError(
                f"{what} got unknown setting(s) {', '.join(unknown)}; "
                f"the settings are {', '.join(sorted(names))}"
            )
        return cls(**settings)

    def engine(self) -> EngineConfig:
        """Just the engine's settings (from a subclass that adds others, e.g. the server's)."""
        if type(self) is EngineConfig:
            return self
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})

    def live(self) -> LiveConfig:
        return LiveConfig(self.max_extend_tokens, self.policy, self.admission)

    def resolve(self, cuda_available: bool) -> EngineConfig:
        """The device-dependent defaults filled in: device (no "auto"), dtype, page_size,
        overlap, and the attention backend batch invariance needs."""
        if self.device == "cuda" and not cuda_available:
            raise InvalidRequest("device 'cuda' was asked for, but CUDA is not available")
        device = "cuda" if self.device == "auto" and cuda_available else self.device
        on_cuda = device == "cuda"
        return replace(
            self.engine(),
            device="cpu" if device == "auto" else device,
            dtype=self.dtype or ("bfloat16" if on_cuda else "float32"),
            page_size=self.page_size or (16 if on_cuda else 1),
            # overlap pays off where the device computes while the host schedules; on CPU the
            # host does both, so each step's tokens are read at once
            overlap=on_cuda if self.overlap is None else self.overlap,
            attention_backend="triton" if self.batch_invariant else self.attention_backend,
        )


# -- the command line, generated from the fields -----------------------------------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per setting of dataclass `cls` (the fields made with `setting`), its default
    the field's, so `--help` and the dataclass cannot disagree."""
    hints = _hints(cls)
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        base, _ = _base_type(hints[f.name])
        kw: dict[str, Any] = {"default": f.default, "help": meta["help"], "dest": f.name}
        if f.default is not None and not isinstance(f.default, tuple):
            kw["help"] += " (default: %(default)s)"
        if meta["metavar"] is not None:
            kw["metavar"] = meta["metavar"]
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is tuple:  # a repeatable option
            kw["action"], kw["default"] = "append", None
            kw["help"] += " (repeatable)"
        else:
            if meta["choices"] is not None:
                kw["choices"] = meta["choices"]
            if meta["parse"] is not None:
                kw["type"] = meta["parse"]
            elif base is int:
                kw["type"] = positive_int if meta["minimum"] == 1 else int
        parser.add_argument(_flag(f.name), **kw)


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    """The dataclass `cls` from parsed options (its repeatable ones as tuples)."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if hasattr(args, f.name):
            v = getattr(args, f.name)
            values[f.name] = tuple(v or ()) if isinstance(f.default, tuple) else v
    return cls(**values)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Facts that do not change while the engine runs (the protocol's `hello.engine`)."""

    model: str
    device: str
    dtype: str
    vocab_size: int
    page_size: int
    num_pages: int
    max_running_req: int
    max_seq_len: int
    cache_type: str
    attention_backend: str
    architecture: str
    overlap: bool
    residual_dtype: str
    batch_invariant: bool
    tp_size: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
