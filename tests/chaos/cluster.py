"""The processes of the chaos soak (soak.py): Redis, a retriever, engines and a gateway on
127.0.0.1, each killable with SIGKILL and restartable on its port; Redis audits; SSD bit flips."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from kvstore import format as kvformat
from kvstore.errors import KVEntryError

REPO_ROOT = Path(__file__).resolve().parents[2]
KV_PREFIX = "ragblend:kv:"  # kvstore.remote_tier.PREFIX: every entry's Redis key starts so
HEADER_FIELD = b"h"  # an entry's header field; layer i is field str(i)
START_TIMEOUT_S = 600.0  # five processes starting at once on 2 cores other jobs keep busy
STOP_TIMEOUT_S = 20.0
# One torch thread per engine: three engines share the machine's cores, and the same thread
# count everywhere keeps every engine's float sums in the same order.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class ClusterError(RuntimeError):
    """A process of the soak did not start; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _redis_ready(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1.0).ping())
    except redis.RedisError:
        return False


@dataclass
class Proc:
    """One process on a fixed loopback port: `command` started with its output in `log_path`;
    ready once `ready_url` answers 200 (or, without one, once Redis on `port` answers PING)."""

    name: str
    command: list[str]
    port: int
    log_path: Path
    ready_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again, on the same port) and wait until ready; ClusterError otherwise."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **self.env},
            )

    def wait_ready(self) -> None:
        """Wait until the launched process is ready; it is stopped and ClusterError raised when
        it exits first or takes longer than START_TIMEOUT_S."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if _ready(self.ready_url) if self.ready_url else _redis_ready(self.port):
                return
            time.sleep(0.1)
        code = self.proc.poll()
        self.stop()
        what = "did not become ready" if code is None else f"exited with {code}"
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise ClusterError(f"{self.name} {what}:\n{tail}")

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed."""
        self.stop(signal.SIGKILL)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig`, wait for the end (SIGKILL after STOP_TIMEOUT_S)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    folder: Path
    engines: int = 3
    redis_maxmemory: str = "3mb"
    memory_budget_gb: float = 0.001  # about 8 demo-model chunks: most hits come from SSD or Redis
    recompute_ratio: float = 0.15  # fixed, so a blend of the same cached KV has one answer
    health_interval_s: float = 0.5


class Cluster:
    """Redis (`allkeys-lru` under `redis_maxmemory`, nothing persisted), a retriever, engines
    sharing that Redis with an SSD folder each, and a gateway over the engines. `close()` kills
    whatever still runs; use it as a context manager."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        folder = config.folder
        folder.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterError("redis-server is not installed (scripts/system-deps.sh test)")
        port = free_port()
        self.redis = Proc(
            "redis",
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder)]
            + ["--save", "", "--appendonly", "no", "--maxmemory", config.redis_maxmemory]
            + ["--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes"],
            port,
            folder / "redis.log",
        )
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self.retriever = self._service(
            "retriever",
            ["--data-dir", str(folder / "retriever"), "--tokenizer", config.model],
        )
        self.ssd_folders = [folder / f"kv-{i}" for i in range(config.engines)]
        self.engines = [
            self._service(
                "engine",
                ["--model", config.model, "--store-path", str(ssd)]
                + ["--kv-encoding", "none", "--memory-budget-gb", str(config.memory_budget_gb)]
                + ["--recompute-ratio", str(config.recompute_ratio)],
                env={**ONE_THREAD, "RAGBLEND_ENGINE_REMOTE_URL": self.redis_url},
                label=f"engine-{i}",
            )
            for i, ssd in enumerate(self.ssd_folders)
        ]
        self.gateway = self._service(
            "gateway",
            ["--retriever-url", self.retriever.url]
            + ["--engine-urls", ",".join(e.url for e in self.engines)]
            + ["--health-interval-s", str(config.health_interval_s)]
            + ["--retrieval-timeout-s", "30"],
        )

    def _service(
        self, name: str, args: list[str], env: dict[str, str] | None = None, label: str = ""
    ) -> Proc:
        port = free_port()
        command = [sys.executable, "-m", "ragblend", name, "--host", "127.0.0.1"]
        command += ["--port", str(port), *args]
        label = label or name
        return Proc(
            label,
            command,
            port,
            self.config.folder / f"{label}.log",
            f"http://127.0.0.1:{port}/health",
            env or {},
        )

    def processes(self) -> list[Proc]:
        return [self.redis, self.retriever, *self.engines, self.gateway]

    def start(self) -> Cluster:
        """Redis first, then the retriever and the engines side by side, then the gateway."""
        self.redis.start()
        middle = [self.retriever, *self.engines]
        for proc in middle:
            proc.launch()
        for proc in middle:
            proc.wait_ready()
        self.gateway.start()
        return self

    def close(self) -> None:
        """Stop everything, gateway first; a process that ignores SIGTERM is killed."""
        for proc in reversed(self.processes()):
            proc.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class RedisAudit:
    """Entries of the remote tier in Redis: whole, poison (a header whose layers are not all
    there: every read fails) and orphans (layer data without a header: invisible, never
    read, and under `noeviction` never freed)."""

    entries: int = 0
    poison: int = 0
    orphans: int = 0


def audit_redis(port: int, num_layers: int, max_keys: int = 100_000) -> RedisAudit:
    """Scan every `ragblend:kv:*` hash (at most `max_keys`); RedisError when Redis is down."""
    client = redis.Redis(port=port, socket_timeout=5.0)
    entries = poison = orphans = 0
    expected = {str(i).encode() for i in range(num_layers)}
    try:
        for count, name in enumerate(client.scan_iter(match=f"{KV_PREFIX}*", count=500)):
            if count >= max_keys:
                break
            fields = set(client.hkeys(name))
            if not fields:
                continue  # evicted or deleted between SCAN and HKEYS
            if HEADER_FIELD not in fields:
                orphans += 1
            elif not expected <= fields:
                poison += 1
            else:
                entries += 1
    finally:
        client.close()
    return RedisAudit(entries, poison, orphans)


def flip_random_bit(folders: list[Path], rng: random.Random, num_layers: int) -> Path | None:
    """Flip one bit in the K data of a random layer of a random SSD entry (`*.kv` under one of
    `folders`), in place, as a failing disk would; the entry flipped, or None when there is none
    (or it vanished meanwhile: evicted or deleted as corrupt)."""
    files = sorted(p for folder in folders if folder.is_dir() for p in folder.rglob("*.kv"))
    if not files:
        return None
    path = rng.choice(files)
    try:
        with path.open("r+b") as entry:
            data_offset = kvformat.header_size(entry.read(kvformat.ALIGN))
            size = entry.seek(0, os.SEEK_END)
            stride = (size - data_offset) // num_layers
            # The first 1,024 bytes of a layer are K of its first tokens (512 bytes a token of
            # the demo model in float32; every chunk has at least two).
            offset = data_offset + rng.randrange(num_layers) * stride + rng.randrange(1024)
            entry.seek(offset)
            byte = entry.read(1)
            if not byte:
                return None
            entry.seek(offset)
            entry.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
    except (OSError, KVEntryError):  # gone, or a header already damaged by an earlier flip
        return None
    return path
