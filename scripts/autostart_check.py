"""Does the page's autostart put the engine where it is fastest? (run on a CUDA machine)

    python scripts/autostart_check.py --out OUT [--model assets/qwen3-0.6b --engine-args "..."]

Runs the page itself (app/main.py, through Streamlit's AppTest: no browser) with autostart on
and nothing listening at its engine URL, as a new user's first `streamlit run app/main.py`
would. The page starts `python -m engine.server --device auto` by its own code path; once it is
connected, the sidebar's engine line is read back and printed. Then a second protocol client
runs the page's "long prompt vs chats" workload against the same engine and records every
message it receives to OUT/autostart-session.jsonl (a `hello` first, as a `--trace` file), so
the session can be opened in the page elsewhere (`streamlit run app/main.py -- --trace FILE`)
and photographed in a browser. Exits 1 if the engine did not come up on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from instrumentation.protocol import ENDED_STATES  # noqa: E402  (torch-free)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sidebar_text(at) -> str:  # noqa: ANN001 (AppTest)
    """The sidebar's markdown and captions (the engine line is a caption)."""
    parts = [*at.sidebar.markdown, *at.sidebar.caption]
    return "\n".join(str(m.value) for m in parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--engine-args", default="", help="extra engine arguments, as the page's "
                   "STEPSCOPE_ENGINE_ARGS")  # fmt: skip
    p.add_argument("--timeout", type=float, default=420.0)
    p.add_argument("--requests-wait", type=float, default=120.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"ws://127.0.0.1:{free_port()}"
    os.environ.update(
        STEPSCOPE_URL=url,
        STEPSCOPE_AUTOSTART="1",
        STEPSCOPE_MODEL=args.model,
        STEPSCOPE_ENGINE_ARGS=args.engine_args,
    )
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=60)
    t0 = time.monotonic()
    line = ""
    while time.monotonic() - t0 < args.timeout:
        at.run()
        text = sidebar_text(at)
        if "**cuda" in text or "**cpu" in text:
            line = next(x for x in text.splitlines() if "**cuda" in x or "**cpu" in x)
            break
        time.sleep(2.0)
    waited = time.monotonic() - t0
    print(f"sidebar engine line after {waited:.0f} s: {line or '(never connected)'}")
    exceptions = [str(e.value) for e in at.exception]
    if exceptions:
        print("page exceptions:", exceptions)

    from app import workloads
    from app.client import EngineLink

    link = EngineLink(url).start()
    deadline = time.monotonic() + 60
    while link.status().state != "connected" and time.monotonic() < deadline:
        time.sleep(0.2)
    snap = link.store.snapshot()
    engine = snap.engine or {}
    # the page's own preset runner, as its "Long prompt vs. chatting requests" button plays it
    run = workloads.PresetRun(workloads.PRESETS_BY_KEY["stall"]).start(link)
    deadline = time.monotonic() + args.requests_wait
    while not run.finished and time.monotonic() < deadline:
        time.sleep(0.5)
    while time.monotonic() < deadline:
        recs = link.store.snapshot(last_steps=0).requests
        if recs and all(r["state"] in ENDED_STATES for r in recs):
            break
        time.sleep(0.5)
    if run.errors:
        print("workload errors:", run.errors)
    log = link.store.log()
    link.close()
    path = args.out / "autostart-session.jsonl"
    with path.open("w") as f:
        for msg in log:
            f.write(json.dumps(msg) + "\n")
    steps = sum(1 for m in log if m.get("type") == "step")
    print(f"recorded {len(log)} messages ({steps} steps) to {path}")
    summary = {"engine_line": line, "seconds_to_connect": waited, "engine": engine}
    (args.out / "autostart.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: engine.get(k) for k in ("device", "dtype", "attention_backend",
                                                  "overlap", "page_size", "num_pages")}))  # fmt: skip
    return 0 if engine.get("device", "").startswith("cuda") else 1


if __name__ == "__main__":
    sys.exit(main())
