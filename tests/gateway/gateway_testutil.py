"""Helpers of the gateway tests: a service process on a fixed port that can be stopped and
restarted, SSE and Prometheus parsing. (Imported as tests.gateway.gateway_testutil.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0

DOCUMENTS = {
    "rivers": "The Zorblax river flows through the city of Quendor. Its water glows blue at "
    "night because of small fish. Fishermen of Quendor sell the fish at the morning market.",
    "mountains": "The Vantir mountains lie north of Quendor and carry snow all year. Travelers "
    "cross them by the old Kessa pass, which is closed in the winter months.",
    "orchards": "Orchards of the Melbrook valley grow silver pears. The harvest festival of "
    "Melbrook is held in the ninth month, with music and pear cakes for every guest.",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Service:
    name: str
    port: int
    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def start(self, ready_path: str = "/health") -> Service:
        """(Re)start on the same port and wait until `ready_path` answers 200."""
        cmd = [sys.executable, "-m", "ragblend", self.name, "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", **self.env)
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log_file,
                                         stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}{ready_path}", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        pytest.fail(f"{self.name} did not become ready:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_precomputed(client: httpx.Client, doc_id: str, timeout_s: float = 120.0) -> dict:
    """The document once its precompute status is no longer pending."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        document = client.get(f"/v1/documents/{doc_id}").json()
        if document["precompute"]["status"] != "pending":
            return document
        time.sleep(0.2)
    raise AssertionError(f"{doc_id} still pending after {timeout_s} s")


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event, data) of each frame; asserts every frame is well formed."""
    frames = []
    assert text.endswith("\n\n"), "the stream ends with a blank line"
    for block in text.strip("\n").split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            name, sep, value = line.partition(": ")
            assert sep, f"malformed SSE line {line!r}"
            if name == "event":
                event = value
            else:
                assert name == "data", f"unexpected SSE field {name!r}"
                data.append(value)
        assert data, f"frame without data: {block!r}"
        frames.append((event, "\n".join(data)))
    return frames


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples `name` whose labels include `labels` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
