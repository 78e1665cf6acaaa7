"""A model directory's tokenizer, loaded without torch (the API process has none)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer classes that are tokenizer.json and nothing more (transformers 5 names the fast
# tokenizer's backend class TokenizersBackend; PreTrainedTokenizerFast is its older name)
GENERIC = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer_at(path: Path | str) -> Any:
    """The tokenizer in `path`. A generic fast tokenizer is loaded as that class directly:
    AutoTokenizer resolves the same class, but only after importing the model's config classes
    (about 2 s of transformers imports, paid by every server process on start)."""
    path = Path(path)
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in GENERIC and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
