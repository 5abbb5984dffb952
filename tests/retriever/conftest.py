"""Fixtures of the retriever tests: the real service started as a subprocess
(`python -m ragblend retriever`) on a free loopback port with a temporary data dir."""

from __future__ import annotations

import signal
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.service_process import REPO_ROOT, Service, service_env, start_service

RetrieverProcess = Service


def start_retriever(
    data_dir: Path, log_path: Path, *args: str, env: dict[str, str] | None = None
) -> Service:
    """Start the service and wait until /health answers 200; fails with its log otherwise."""
    return start_service("retriever", ["--data-dir", str(data_dir), *args], log_path, env=env)


def make_pdf(pages: list[str], deflate: bool = False) -> bytes:
    """A minimal text PDF (Helvetica, one page per string) with a correct xref table;
    `deflate`: page contents FlateDecode-compressed (a small file with a large text)."""
    objects: list[bytes] = []
    n_pages = len(pages)
    font_id = 3 + 2 * n_pages
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n_pages))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {n_pages} >>".encode())
    for i, text in enumerate(pages):
        escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
        stream = f"BT /F1 12 Tf 72 720 Td ({escaped}) Tj ET".encode()
        flate = b""
        if deflate:
            stream, flate = zlib.compress(stream, 9), b" /Filter /FlateDecode"
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
            f"/Resources << /Font << /F1 {font_id} 0 R >> >> >>".encode()
        )
        objects.append(
            b"<< /Length %d%s >>\nstream\n" % (len(stream), flate) + stream + b"\nendstream"
        )
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
        len(objects) + 1,
        xref,
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
            [sys.executable, "-m", "ragblend", *args],
            cwd=REPO_ROOT,
            env=service_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    return run


SpawnRetriever = Callable[..., RetrieverProcess]


@pytest.fixture
def spawn_retriever(tmp_path: Path) -> Iterator[SpawnRetriever]:
    """Start retriever processes of one test (own data dirs allowed); all killed afterwards."""
    started: list[RetrieverProcess] = []

    def spawn(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> RetrieverProcess:
        """`env`: variables set on top of the usual environment."""
        service = start_retriever(data_dir, tmp_path / "retriever.log", *args, env=env)
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
