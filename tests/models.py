"""Tiny random-weight Hugging Face models for tests: checks.models, which the scripts
share (scripts never import tests), and `cached_tiny`, which makes each once per machine."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import checks.models
from checks.models import ARCHS, TINY_COMMON, make_tiny, make_wide_model

__all__ = ["ARCHS", "TINY_COMMON", "cached_tiny", "make_tiny", "make_wide_model"]


def cached_tiny(kind: str, tokenizer_dir: Path, **options: Any) -> Path:
    """`make_tiny(kind, ..., **options)`, made once per machine and shared by every test process
    (each pytest worker made its own: about 11 CPU-s apiece). The directory is named by what
    decides its bytes: the arguments, the tokenizer, checks/models.py, torch and transformers."""
    import torch
    import transformers
    from filelock import FileLock

    from engine.models.loader import cache_root

    key = json.dumps(
        [kind, sorted(options.items()), str(tokenizer_dir), torch.__version__,
         transformers.__version__, Path(checks.models.__file__).read_text()],
        default=str,
    )  # fmt: skip
    path = cache_root() / "test-models" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not path.is_dir():  # another process made it while this one waited
            tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
            try:
                make_tiny(kind, tmp, tokenizer_dir, **options)
                tmp.rename(path)  # whole or not at all
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return path
