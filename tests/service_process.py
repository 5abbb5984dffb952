"""Starting a ragblend service as a real process on a free 127.0.0.1 port, for the tests.

(Imported as tests.service_process.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def service_env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env.update(extra)
    return env


@dataclass
class ServiceProcess:
    name: str
    url: str
    port: int
    log_path: Path
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout_s: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout_s)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig` and wait for the process to end; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_service(
    name: str,
    args: list[str],
    log_path: Path,
    port: int | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 180.0,
) -> ServiceProcess:
    """`python -m ragblend NAME --host 127.0.0.1 --port P ARGS...`, once /health answers 200."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "ragblend",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env or service_env()
        )
    service = ServiceProcess(name, f"http://127.0.0.1:{port}", port, log_path, proc)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}:\n{service.log()[-4000:]}")
        try:
            if httpx.get(f"{service.url}/health", timeout=2.0).status_code == 200:
                return service
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    service.stop(signal.SIGKILL)
    pytest.fail(f"{name} did not become healthy:\n{service.log()[-4000:]}")
