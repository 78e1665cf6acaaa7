"""`python3 -m scripts.gpu_check`: see __init__.py."""

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for engine/

from scripts.gpu_check.main import main  # noqa: E402

with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
