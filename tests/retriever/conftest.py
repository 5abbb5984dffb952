"""Fixtures of the retriever tests: the real service started as a subprocess
(`python -m ragblend retriever`) on a free loopback port with a temporary data dir."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def service_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


@dataclass
class RetrieverProcess:
    url: str
    data_dir: Path
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
        return self.proc.wait(timeout=timeout_s)


def start_retriever(
    data_dir: Path, log_path: Path, *args: str, env: dict[str, str] | None = None
) -> RetrieverProcess:
    """Start the service and wait until /health answers 200; fails with its log otherwise."""
    port = free_port()
    cmd = [sys.executable, "-m", "ragblend", "retriever", "--host", "127.0.0.1",
           "--port", str(port), "--data-dir", str(data_dir), *args]
    log_file = open(log_path, "ab")  # noqa: SIM115 - the child keeps writing to it
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                            env=env or service_env())
    log_file.close()
    service = RetrieverProcess(f"http://127.0.0.1:{port}", data_dir, log_path, proc)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"retriever exited with {proc.returncode}:\n{service.log()[-4000:]}")
        try:
            if httpx.get(f"{service.url}/health", timeout=2.0).status_code == 200:
                return service
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    service.stop(signal.SIGKILL)
    pytest.fail(f"retriever did not become healthy:\n{service.log()[-4000:]}")


def make_pdf(pages: list[str]) -> bytes:
    """A minimal text PDF (Helvetica, one page per string) with a correct xref table."""
    objects: list[bytes] = []
    n_pages = len(pages)
    font_id = 3 + 2 * n_pages
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n_pages))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {n_pages} >>".encode())
    for i, text in enumerate(pages):
        escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
        stream = f"BT /F1 12 Tf 72 720 Td ({escaped}) Tj ET".encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
            f"/Resources << /Font << /F1 {font_id} 0 R >> >> >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % off for off in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1, xref
    )
    return bytes(out)


@pytest.fixture
def pdf_bytes() -> Callable[[list[str]], bytes]:
    """make_pdf: a text PDF with one page per string."""
    return make_pdf


@pytest.fixture
def run_ragblend() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `python -m ragblend ARGS...` to completion, capturing its output."""

    def run(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ragblend", *args], cwd=REPO_ROOT, env=service_env(),
            capture_output=True, text=True, timeout=timeout_s,
        )

    return run


SpawnRetriever = Callable[..., RetrieverProcess]


@pytest.fixture
def spawn_retriever(tmp_path: Path) -> Iterator[SpawnRetriever]:
    """Start retriever processes of one test (own data dirs allowed); all killed afterwards."""
    started: list[RetrieverProcess] = []

    def spawn(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> RetrieverProcess:
        """`env`: variables set on top of the usual environment."""
        service = start_retriever(
            data_dir, tmp_path / "retriever.log", *args, env=service_env(**(env or {}))
        )
        started.append(service)
        return service

    yield spawn
    for service in started:
        if service.proc.poll() is None:
            service.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def shared_retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RetrieverProcess]:
    """One service for the tests that only add to the collection: 128-token chunks, at most
    50 results per search."""
    base = tmp_path_factory.mktemp("shared-retriever")
    service = start_retriever(
        base / "data", base / "retriever.log", "--chunk-tokens", "128", "--max-top-k", "50"
    )
    yield service
    service.stop(signal.SIGTERM)


@pytest.fixture
def client(shared_retriever: RetrieverProcess) -> Iterator[httpx.Client]:
    with shared_retriever.client() as http:
        yield http
