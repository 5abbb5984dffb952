"""A real redis-server on a free 127.0.0.1 port in a temp dir, stoppable, killable and restartable
on the same port, for the remote-tier tests. (Imported as tests.redis_server.)"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.service_process import free_port

STARTUP_TIMEOUT_S = 20.0


def ping(port: int) -> bool:
    """Whether a Redis on `port` answers PING (RESP, without a client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """`redis-server` on 127.0.0.1:`port`, nothing persisted (`--save "" --appendonly no`),
    evicting least recently used keys under `maxmemory` (0: no limit) like a production tier
    (or refusing writes there, with `policy="noeviction"`)."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        maxmemory: str = "0",
        policy: str = "allkeys-lru",
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: run `scripts/system-deps.sh test` "
                "(Debian package redis-server)"
            )
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (again) on the same port and wait until it answers PING."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            self.policy,
            "--protected-mode",
            "yes",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                pytest.fail(f"redis-server did not start:\n{self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGKILL: as if it crashed) and wait until the process is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def limit_memory(self, headroom_bytes: int) -> int:
        """Set `maxmemory` to what the running server uses now (INFO's `used_memory`, about 0.9
        MB for an empty Redis 7, varying by build and machine) plus `headroom_bytes`, so that a
        test's limit means the same everywhere; returns the limit in bytes."""
        with redis.Redis.from_url(self.url) as client:
            used = int(client.info("memory")["used_memory"])
            limit = used + headroom_bytes
            client.config_set("maxmemory", limit)
        return limit


@contextmanager
def redis_server(
    workdir: Path, maxmemory: str = "0", policy: str = "allkeys-lru"
) -> Iterator[RedisServer]:
    """A started RedisServer, stopped on exit."""
    server = RedisServer(workdir, maxmemory=maxmemory, policy=policy).start()
    try:
        yield server
    finally:
        server.stop()
