"""A fleet in one command: N engine replicas (each its own `python -m engine.server` process)
behind SGLang's Model Gateway (`sglang-router`, `--backend sglang`).

    python -m engine.server.fleet --replicas 2 --router-policy cache_aware -- --model smollm2

Everything after `--` goes to every replica. Each replica gets its own WebSocket and HTTP port;
on CUDA, `--gpus 0,1` deals replicas to GPUs round-robin (by default they share the visible
device). The fleet file (`--fleet-file`, default ~/.cache/stepscope/fleet.json) names every
replica's WebSocket and HTTP URL and the gateway's, so the page can find them
(`STEPSCOPE_URL=<the printed list>` or `--fleet FILE`). `--trace-dir DIR` records the fleet:
each replica writes its `--trace` to DIR/replica-<i>.jsonl (its hello, whose `clock_epoch` puts
every replica on one clock, then every message), which the page replays side by side
(`streamlit run app/main.py -- --fleet-trace DIR`). SIGTERM or Ctrl-C stops the gateway
and then the replicas; a replica that dies stops the fleet with an error naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0
TRACE_NAME = "replica-{i}.jsonl"  # a fleet recording's file per replica (app/fleet_replay.py)


def default_fleet_file() -> Path:
    root = os.environ.get("STEPSCOPE_CACHE") or os.path.expanduser("~/.cache/stepscope")
    return Path(root) / "fleet.json"


@dataclass(frozen=True, slots=True)
class Replica:
    name: str
    ws: str
    http: str
    pid: int
    trace: str | None = None  # its recording (--trace-dir), DIR/replica-<i>.jsonl


@dataclass(frozen=True, slots=True)
class FleetInfo:
    replicas: list[Replica]
    gateway: str | None
    router_policy: str | None
    trace_dir: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @property
    def ws_urls(self) -> str:
        return ",".join(r.ws for r in self.replicas)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Proc:
    """A child process whose output is copied to ours with a prefix, and whose ready lines
    (`stepscope engine ready at URL`, `stepscope HTTP API at URL`) are caught on the way."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.ws: str | None = None
        self.http: str | None = None
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,  # our Ctrl-C reaches them through stop(), in order
        )  # fmt: skip
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, out: IO[str] | None) -> None:
        assert out is not None
        for line in out:
            if line.startswith("stepscope engine ready at "):
                self.ws = line.split(" at ", 1)[1].strip()
            elif line.startswith("stepscope HTTP API at "):
                self.http = line.split(" at ", 1)[1].strip()
                self._ready.set()
            sys.stderr.write(f"[{self.name}] {line}")
        self._ready.set()  # it exited: whoever waits must look at poll()

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or self.proc.poll() is not None or self.http is None:
            raise RuntimeError(
                f"{self.name} did not start (exit status {self.proc.poll()}); see its output above"
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait_http(url: str, timeout: float, proc: _Proc) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with status {proc.proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not answer at {url} within {timeout:.0f} s")


class Fleet:
    """Start with `start()`; `stop()` ends the gateway, then the replicas. A context manager."""

    def __init__(
        self,
        replicas: int,
        engine_args: list[str],
        *,
        router_policy: str | None = "cache_aware",
        host: str = "127.0.0.1",
        gateway_port: int = 30000,
        gpus: list[str] | None = None,
        python: str = sys.executable,
        trace_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {replicas}")
        if router_policy is not None and router_policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {router_policy!r}; one of {ROUTER_POLICIES}")
        if router_policy == "power_of_two" and replicas < 2:
            raise ValueError("the gateway's power_of_two policy needs at least 2 replicas")
        for flag in ("--port", "--http-port", "--host"):
            if flag in engine_args:
                raise ValueError(f"{flag} is set per replica by the fleet; leave it out")
        if any(a == "--trace" or a.startswith("--trace=") for a in engine_args):
            raise ValueError("--trace would have every replica write one file; "
                             "use the fleet's --trace-dir DIR (a file per replica)")  # fmt: skip
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        self.n, self.engine_args, self.router_policy = replicas, engine_args, router_policy
        self.host, self.gateway_port, self.gpus, self.python = host, gateway_port, gpus, python
        self.procs: list[_Proc] = []
        self.gateway: _Proc | None = None
        self.info: FleetInfo | None = None

    def start(self) -> FleetInfo:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def trace_path(self, i: int) -> Path | None:
        return None if self.trace_dir is None else self.trace_dir / TRACE_NAME.format(i=i)

    def _start(self) -> FleetInfo:
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            env = dict(os.environ)
            if self.gpus:
                env["CUDA_VISIBLE_DEVICES"] = self.gpus[i % len(self.gpus)]
            cmd = [self.python, "-m", "engine.server", "--host", self.host,
                   "--port", str(free_port(self.host)), "--http-port", str(free_port(self.host)),
                   *self.engine_args]  # fmt: skip
            if (trace := self.trace_path(i)) is not None:
                cmd += ["--trace", str(trace)]
            self.procs.append(_Proc(f"replica {i}", cmd, env))
        for p in self.procs:
            p.wait_ready(READY_TIMEOUT_S)
        gateway_url = self.start_gateway(self.router_policy) if self.router_policy else None
        self.info = FleetInfo(
            replicas=[
                Replica(
                    p.name,
                    p.ws or "",
                    p.http or "",
                    p.proc.pid,
                    None if (t := self.trace_path(i)) is None else str(t),
                )  # fmt: skip
                for i, p in enumerate(self.procs)
            ],
            gateway=gateway_url,
            router_policy=self.router_policy,
            trace_dir=None if self.trace_dir is None else str(self.trace_dir),
        )
        return self.info

    def start_gateway(self, policy: str) -> str:
        """(Re)start the gateway in front of the replicas with `policy`; its URL."""
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; one of {ROUTER_POLICIES}")
        self.stop_gateway()
        url = f"http://{self.host}:{self.gateway_port}"
        cmd = [self.python, "-m", "sglang_router.launch_router", "--backend", "sglang",
               "--host", self.host, "--port", str(self.gateway_port), "--policy", policy,
               "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
               "--log-level", "warn",
               "--worker-urls", *(p.http for p in self.procs if p.http)]  # fmt: skip
        self.gateway = _Proc("gateway", cmd)
        _wait_http(url + "/v1/models", 60, self.gateway)
        self.router_policy = policy
        return url

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None

    def dead(self) -> _Proc | None:
        for p in [*self.procs, *([self.gateway] if self.gateway else [])]:
            if p.proc.poll() is not None:
                return p
        return None

    def stop(self) -> None:
        self.stop_gateway()
        for p in self.procs:
            p.stop()

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.server.fleet",
        description="N stepscope engine replicas behind SGLang's Model Gateway. Arguments "
        "after `--` go to every replica (python -m engine.server --help).",
    )
    p.add_argument("--replicas", type=int, default=2, help="engine processes (default 2)")
    p.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cache_aware",
                   help="the gateway's routing policy (default cache_aware)")  # fmt: skip
    p.add_argument("--no-gateway", action="store_true", help="start the replicas only")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--gateway-port", type=int, default=30000)
    p.add_argument("--gpus", default=None,
                   help="CUDA devices to deal replicas to, comma-separated (e.g. 0,1); "
                   "by default every replica uses the visible device")  # fmt: skip
    p.add_argument("--fleet-file", type=Path, default=None,
                   help="where to write the fleet's URLs (default ~/.cache/stepscope/fleet.json)")  # fmt: skip
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="record the fleet: each replica's --trace as DIR/replica-<i>.jsonl, "
                   "for the page's fleet replay (--fleet-trace DIR)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_args = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    try:
        fleet = Fleet(
            args.replicas, engine_args, host=args.host, gateway_port=args.gateway_port,
            router_policy=None if args.no_gateway else args.router_policy,
            gpus=args.gpus.split(",") if args.gpus else None, trace_dir=args.trace_dir,
        )  # fmt: skip
    except ValueError as exc:
        print(f"stepscope fleet: {exc}", file=sys.stderr)
        return 2
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        info = fleet.start()
    except (RuntimeError, OSError) as exc:
        print(f"stepscope fleet: {exc}", file=sys.stderr)
        return 1
    path = args.fleet_file or default_fleet_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(info.to_json())
    print(f"stepscope fleet ready: {len(info.replicas)} replicas, fleet file {path}", flush=True)
    if info.gateway:
        print(f"gateway (OpenAI API): {info.gateway}/v1", flush=True)
    print(f"STEPSCOPE_URL={info.ws_urls}", flush=True)
    if info.trace_dir:
        print(f"recording to {info.trace_dir} (replay: --fleet-trace {info.trace_dir})", flush=True)
    status = 0
    while not stopping.wait(0.5):
        dead = fleet.dead()
        if dead is not None:
            print(f"stepscope fleet: {dead.name} exited with status {dead.proc.returncode}; "
                  "stopping the fleet", file=sys.stderr)  # fmt: skip
            status = 1
            break
    fleet.stop()
    path.unlink(missing_ok=True)
    print("stepscope fleet: stopped", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
