"""Screenshots of recordings replayed in the page (Chromium through Playwright, on this machine):
the page opens recording A (`--trace`), optionally compares it with B ("Compare with…"), with the
timeline's x axis in engine steps or engine time, and the page is photographed whole.

    python scripts/replay_shots.py --trace A.jsonl [--compare B.jsonl] [--xmode time] --out PNG

Used for recordings made where no browser is (the lent GPU): scripts/stall_recording.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.checks.browser import CHROMIUM, CHROMIUM_ARGS, running_app  # noqa: E402

# a zoom as a user's drag makes it: the page keeps it (uirevision) through its redraws
ZOOM = "(gd, r) => window.Plotly.relayout(gd, {'xaxis.range': r, 'xaxis.autorange': false})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--compare", type=Path, default=None)
    p.add_argument("--xmode", choices=("step", "time"), default="step")
    p.add_argument("--xrange", default=None, help="A,B: zoom the timeline's x axis to [A, B]")
    p.add_argument("--chart", action="store_true", help="photograph the timeline chart only")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=2200)
    args = p.parse_args()
    from playwright.sync_api import expect, sync_playwright

    # the engine URL is never contacted while a recording is open
    with running_app("ws://127.0.0.1:9", STEPSCOPE_TRACE=str(args.trace.resolve())) as url:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": args.width, "height": args.height})
                page.set_default_timeout(120_000)
                expect.set_options(timeout=120_000)
                page.goto(url)
                expect(page.get_by_text("replaying").first).to_be_visible()
                if args.xmode != "step":
                    page.get_by_text(args.xmode, exact=True).first.click()
                    page.wait_for_timeout(3000)
                if args.compare is not None:
                    page.get_by_text("Compare with…").click()
                    box = page.get_by_label("Second recording")
                    box.fill(str(args.compare.resolve()))
                    box.press("Enter")
                    expect(page.get_by_text("Compare").nth(1)).to_be_visible()
                page.wait_for_timeout(8000)  # the charts draw after the script run
                plot = None
                for frame in page.frames:  # the timeline: the Plotly chart titled "tokens in step"
                    found = frame.locator(".js-plotly-plot", has_text="tokens in step")
                    if found.count():
                        plot = found.first
                        if args.xrange:
                            lo, hi = (float(x) for x in args.xrange.split(","))
                            plot.evaluate(ZOOM, [lo, hi])
                        break
                page.wait_for_timeout(2000)
                if args.chart and plot is not None:
                    plot.screenshot(path=str(args.out))
                else:
                    page.screenshot(path=str(args.out), full_page=True)
            finally:
                browser.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
