"""The redis-server `ragblend up --redis` starts as the engines' shared KV tier: loopback only,
nothing persisted, and waited for until it answers PING."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from ragblend.children import Child, UpError, die_with_parent
from ragblend.supervisor import check_started

REDIS_READY_TIMEOUT_S = 30.0


def redis_child(port: int, data_dir: Path, maxmemory: str) -> Child:
    """redis-server on 127.0.0.1 only, its files in `data_dir`, nothing persisted: the KV it
    holds is a cache the engines refill. Without a password, so loopback only."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise UpError(
            "--redis needs redis-server, which is not installed (on Debian or Ubuntu: "
            "apt-get install redis-server); or run without --redis"
        )
    cmd = [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(data_dir),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        maxmemory,
        "--maxmemory-policy",
        "allkeys-lru",
    ]
    preexec = die_with_parent if sys.platform.startswith("linux") else None
    return Child("redis", port, cmd, dict(os.environ), preexec=preexec)


def wait_redis(redis: Child, timeout_s: float = REDIS_READY_TIMEOUT_S) -> None:
    """Until it answers PING (the engines would start with their remote tier unreachable)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_started([redis])
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", redis.port), timeout=1.0) as sock,
        ):
            sock.sendall(b"PING\r\n")
            if sock.recv(64).startswith(b"+PONG"):
                return
        time.sleep(0.1)
    raise UpError(f"redis-server did not answer on port {redis.port} after {timeout_s:.0f} s")
