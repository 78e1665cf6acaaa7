"""stepscope's tests. Imported before any of them (and before torch), so that what is set here
holds for the test processes and every process they start."""

import os
import sys
from pathlib import Path

# Where bytecode is not written (PYTHONDONTWRITEBYTECODE, as on CI machines of this kind), every
# Python process the suite starts (its workers, servers, engines, Streamlit) compiled torch's,
# transformers' and streamlit's sources afresh on import: about 4 CPU-s each, for dozens of
# processes. They share a bytecode cache outside the tree instead (each file is checked against
# its source, as in any __pycache__). The cache's root is engine.models.loader.cache_root's,
# spelled out here: that module imports torch, which must come after this.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) and "PYTHONPYCACHEPREFIX" not in os.environ:
    _cache = os.environ.get("STEPSCOPE_CACHE") or str(Path.home() / ".cache" / "stepscope")
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = str(Path(_cache) / "test-pycache")
    sys.dont_write_bytecode = False
