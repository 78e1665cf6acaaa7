"""stepscope's inference engine: paged KV cache, radix prefix cache, chunked prefill.

`from engine import LLM, EngineConfig, SamplingParams`. They are imported lazily, so torch-free
modules such as `instrumentation.records` can be used without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from instrumentation.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from instrumentation.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
