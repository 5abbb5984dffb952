"""A ragblend service as a real process on a 127.0.0.1 port, restartable on that port, for
the tests. (Imported as tests.service_process.)"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 180.0


# Below Linux's ephemeral range (32768-60999): no outgoing connection takes one of these
# between the check and the service's bind, as it can take an ephemeral port. `make test` runs
# pytest-xdist workers: each picks from its own slice, so two never pick one port.
_PORTS = range(20000, 32000)


def _worker_ports() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = len(_PORTS) // max(count, 1)
    start = _PORTS.start + int(worker) * size
    return range(start, start + size)


def free_port() -> int:
    return free_port_run(1)


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports that are all free (for `up --engines N`, which
    puts engine i on the first port + i)."""
    ports, rng = _worker_ports(), random.Random()
    for _ in range(200):
        base = rng.randrange(ports.start, ports.stop - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports in {ports}")


def service_env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env.update(extra)
    return env


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> bool:
    """Poll `url` until it answers 200 (True), the process ends or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


@dataclass
class Service:
    """`python -m ragblend NAME --host 127.0.0.1 --port PORT ARGS...`; `env` adds variables;
    `core` pins the process to that CPU core from its start (bench/scale.py's engines)."""

    name: str
    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    core: int | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout_s: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout_s)

    def start(self, ready_path: str = "/health") -> Service:
        """(Re)start on the same port and wait until `ready_path` answers 200."""
        cmd = [
            sys.executable,
            "-m",
            "ragblend",
            self.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=service_env(**self.env),
                preexec_fn=None if self.core is None else self._pin,
            )
        if wait_ready(self.proc, f"{self.url}{ready_path}", STARTUP_TIMEOUT_S):
            return self
        code = self.proc.poll()
        self.stop(signal.SIGKILL)
        what = "did not become ready" if code is None else f"exited with {code}"
        pytest.fail(f"{self.name} {what}:\n{self.log()[-4000:]}")

    def _pin(self) -> None:
        os.sched_setaffinity(0, {self.core})

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        """Send `sig` and wait for the end (SIGKILL after `timeout_s`); the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_service(
    name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Service:
    return Service(name, list(args), log_path, env=env or {}).start()
