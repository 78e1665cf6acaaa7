"""The browser tests' harness (the page benchmarks use it too): a `python -m engine.server` and a
`streamlit run app/main.py` started on free ports and stopped again, Debian's chromium (one per
run of consecutive browser tests) and the tabs the tests open in it, and a protocol client that
keeps requests decoding."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(15)


@contextlib.contextmanager
def running_engine(
    model_dir: Path | str, *flags: str, port: int = 0, root: Path = ROOT
) -> Iterator[str]:
    """`python -m engine.server` on the given model; yields its URL once it is ready."""
    argv = [sys.executable, "-m", "engine.server", "--port", str(port), "--model", str(model_dir)]
    argv += ["--http-port", "0", "--device", "cpu", *flags]
    proc = subprocess.Popen(
        argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:  # loading progress, then one line with the URL
            if "ready at ws://" in line:
                url = line[line.index("ws://") :].strip()
                break
        if not url:
            raise RuntimeError("the engine exited before it was ready")
        # keep reading, so the engine never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        yield url
    finally:
        stop_process(proc)


# One chromium for consecutive browser tests: a launch and its first page cost about 6 CPU-s in
# chromium, a tab in a running one 1-2 (measured). It is closed when the next test is not a
# browser test (tests/browser/conftest.py): Playwright's sync API keeps an asyncio loop running
# in its thread, and a test that runs its own loop there fails.
_SHARED: dict[str, Any] = {}


def shared_browser() -> Any:
    """The running chromium, launched if there is none (or it died)."""
    from playwright.sync_api import sync_playwright

    browser = _SHARED.get("browser")
    if browser is None or not browser.is_connected():
        close_shared_browser()
        _SHARED["playwright"] = sync_playwright().start()
        chromium = _SHARED["playwright"].chromium
        _SHARED["browser"] = chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    return _SHARED["browser"]


def close_shared_browser() -> None:
    browser, playwright = _SHARED.pop("browser", None), _SHARED.pop("playwright", None)
    with contextlib.suppress(Exception):  # already gone with its process
        if browser is not None:
            browser.close()
    if playwright is not None:
        playwright.stop()


@contextlib.contextmanager
def tab(
    url: str | None, width: int = 1600, height: int = 1300, timeout_ms: int = 90_000
) -> Iterator[Any]:
    """A new tab (its own browser context: a new Streamlit session, no shared storage) in the
    shared chromium, at `url`, with `timeout_ms` for its waits and Playwright's expect; what the
    page said is printed if the test fails in it (PageLog). Closed after."""
    from playwright.sync_api import expect

    page = shared_browser().new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(timeout_ms)
    expect.set_options(timeout=timeout_ms)
    try:
        with PageLog(page):
            if url is not None:
                page.goto(url)
            yield page
    finally:
        with contextlib.suppress(Exception):
            page.close()


def status_line(page: Any, text: Any) -> Any:
    """The page's status line (not the toast that repeats it)."""
    return page.get_by_test_id("stAlertContentSuccess").get_by_text(text)


def act_until(
    act: Callable[[], None],
    shown: Any,
    again: Callable[[], bool] | None = None,
    tries: int = 3,
    each_ms: int = 20_000,
) -> None:
    """Do `act` until `shown` (a locator) is visible. On a busy machine a rerun that reaches the
    browser between a key press or click and its commit can re-render the widget with its old
    value, and the interaction is lost (seen on CI: the budget slider still at 32 after 90 s).
    A user does it again; so does this, while `again()` says the effect is not under way."""
    from playwright.sync_api import expect

    for k in range(tries):
        act()
        try:
            expect(shown).to_be_visible(timeout=each_ms)
            return
        except AssertionError:
            if k == tries - 1:
                raise
            if again is not None and not again():
                expect(shown).to_be_visible()  # under way: wait it out
                return


def enter_text(box: Any, text: str) -> None:
    """Type `text` into a text box and press Enter. A commit lost to a rerun leaves the box
    "clean" with the text in it, and Enter on an unchanged box sends nothing (seen: a recording's
    path in the box three tries running, never opened): a box that holds something is cleared,
    and that committed, first, so that the Enter is a change again."""
    if box.input_value():
        box.fill("")
        box.press("Enter")
    box.fill(text)
    box.press("Enter")


def submit(page: Any, prompt: str, max_tokens: int, copies: int | None = None) -> None:
    """Type a prompt, its max_tokens (and how many copies) into the form and click Submit."""
    page.get_by_label("Prompt").fill(prompt)
    page.locator(".st-key-max_tokens input").fill(str(max_tokens))
    if copies is not None:
        page.locator(".st-key-copies input").fill(str(copies))
    page.get_by_role("button", name="Submit").click()


APP_LOGS: dict[str, Path] = {}  # a running app's URL: its process's output


def app_log_tail(page_url: str, lines: int = 40) -> str:
    """The last lines the Streamlit process serving `page_url` printed."""
    origin = "/".join(page_url.split("/")[:3])
    path = APP_LOGS.get(origin)
    if path is None or not path.exists():
        return "(no log of the page's server)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(the page's server printed nothing)"


@contextlib.contextmanager
def running_app(engine_url: str, root: Path = ROOT, **env: str) -> Iterator[str]:
    """`streamlit run app/main.py` on a free port, watching `engine_url`; yields the page URL."""
    port = free_port()
    inherited = {k: v for k, v in os.environ.items() if k != "STEPSCOPE_TRACE"}  # no recording
    env = {**inherited, "STEPSCOPE_URL": engine_url, "STEPSCOPE_AUTOSTART": "0", **env}
    argv = [sys.executable, "-m", "streamlit", "run", "app/main.py", "--server.headless", "true"]
    argv += ["--server.port", str(port), "--browser.gatherUsageStats", "false"]
    # its output goes to a file that a failing test prints (PageLog): a page that lost its
    # server says little more than "disconnected"
    log = tempfile.NamedTemporaryFile("w+b", prefix="streamlit-", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    APP_LOGS[url] = Path(log.name)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health") as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)
        log.close()
        APP_LOGS.pop(url, None)
        Path(log.name).unlink(missing_ok=True)


class Workload:
    """A protocol client that keeps `n` greedy requests in flight (a new one per ended one);
    `steps` counts the engine's steps, `decoding` the decodes of the last one."""

    def __init__(self, url: str, n: int, max_tokens: int, seed: int = 0) -> None:
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.rng = random.Random(seed)
        self.steps = 0
        self.decoding = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Workload:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _submit(self, ws: object, k: int) -> None:
        ids = [self.rng.randrange(3, 40000) for _ in range(self.rng.randint(8, 40))]
        cmd = {"type": "submit", "id": f"w{k}", "input_ids": ids, "max_tokens": self.max_tokens}
        ws.send(json.dumps(cmd | {"ignore_eos": True}))  # type: ignore[attr-defined]

    def _run(self) -> None:
        from websockets.sync.client import connect

        with connect(self.url, max_size=2**27) as ws:
            ws.recv()  # hello
            sent = 0
            for _ in range(self.n):
                self._submit(ws, sent)
                sent += 1
            while not self._stop.is_set():
                try:
                    msg = json.loads(ws.recv(timeout=1))
                except TimeoutError:
                    continue
                if msg.get("type") == "step":
                    self.steps += 1
                    self.decoding = sum(1 for i in msg.get("items", ()) if i["kind"] == "decode")
                elif msg.get("type") == "request" and msg.get("event") == "finished":
                    self._submit(ws, sent)
                    sent += 1


LIVE_STATE_JS = """() => [...document.querySelectorAll('.stepscope-live')].map(r => {
    // the heading above each chart (a fleet page's replica), and whether Streamlit marked the
    // element stale (left from an earlier run)
    const block = r.closest('[data-testid="stElementContainer"]');
    const heads = [...document.querySelectorAll('h1, h2, h3, h4')].filter(h =>
        h.compareDocumentPosition(r) & Node.DOCUMENT_POSITION_FOLLOWING);
    return {...r.dataset, shown: r.offsetParent !== null,
            status: (r.querySelector('.sl-status') || {}).textContent,
            under: heads.length ? heads[heads.length - 1].textContent : null,
            stale: block ? block.getAttribute('data-stale') : null};
})"""


OPEN_PAGE_LOGS: list[PageLog] = []  # a tab a fixture holds is still open when its test fails


class PageLog:
    """What a page said while a test drove it (console messages, page errors, failed requests),
    and its live charts' state: printed when the test fails, so a failure seen only on a busy
    CI machine says where the page stood (for a tab a fixture holds, tests/browser/conftest.py
    adds it to the failure's report)."""

    def __init__(self, page: object, keep: int = 40) -> None:
        self.page, self.keep = page, keep
        self.first: list[str] = []  # what went wrong first, and what it kept saying
        self.lines: list[str] = []
        t0 = time.monotonic()
        stamp = lambda: f"{time.monotonic() - t0:7.2f}s"  # noqa: E731
        on = page.on  # type: ignore[attr-defined]
        on("console", lambda m: self._add(f"{stamp()} console.{m.type}: {m.text[:300]}"))
        on("pageerror", lambda e: self._add(f"{stamp()} page error: {e}"))
        on("requestfailed", lambda r: self._add(f"{stamp()} failed: {r.url} {r.failure}"))

    def _add(self, line: str) -> None:
        if len(self.first) < self.keep:
            self.first.append(line)
        else:
            self.lines.append(line)
            del self.lines[: -self.keep]

    def report(self) -> str:
        try:
            live = self.page.evaluate(LIVE_STATE_JS)  # type: ignore[attr-defined]
            switch = self.page.get_by_role("switch", name="Live")  # type: ignore[attr-defined]
            checked = switch.is_checked(timeout=2_000) if switch.count() else None
            main = self.page.locator('[data-testid="stMain"]')  # type: ignore[attr-defined]
            outline = main.aria_snapshot(timeout=5_000)[:4000]
        except Exception as exc:  # the page may be gone: the log still helps
            live, checked, outline = f"unreadable ({exc})", None, ""
        head = [f"live charts: {live}", f"Live switch checked: {checked}", *self.first]
        tail = (["..."] if self.lines else []) + self.lines
        server = ["---- the page's server said ----", app_log_tail(self.page.url)]  # type: ignore[attr-defined]
        return "\n".join(head + tail + server + ["---- the page's main area ----", outline])

    def __enter__(self) -> PageLog:
        OPEN_PAGE_LOGS.append(self)
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        OPEN_PAGE_LOGS.remove(self)
        if kind is not None:
            print(f"---- the page when the test failed ----\n{self.report()}")
