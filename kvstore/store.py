"""The KV store facade the engine uses: memory tier over SSD tier, write-through to SSD on a
background worker thread, and layer streams over both tiers."""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore import format as kvformat
from kvstore.loader import KVLayerStream, LayerSource, MemorySource
from kvstore.memory_tier import MemoryTier
from kvstore.ssd_tier import CheckReport, SSDEntryReader, SSDTier, is_entry_fault
from kvstore.types import ChunkKV, TierStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVStoreConfig:
    """Budgets in bytes; `ssd_path=None` keeps the store in memory only."""

    model_fingerprint: str
    memory_budget_bytes: int = 2 * 1024**3
    ssd_path: str | Path | None = None
    ssd_budget_bytes: int = 64 * 1024**3
    pin_memory: bool = False  # set when the engine runs on CUDA
    lookahead: int = 2
    direct_io: bool = True  # O_DIRECT reads where the filesystem supports them

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        if min(self.memory_budget_bytes, self.ssd_budget_bytes, self.lookahead) < 0:
            raise ValueError(f"budgets and lookahead must be >= 0: {self}")


@dataclass
class StoreStats:
    """Counters per tier (`ssd` is None without an SSD tier) and the state of the SSD writes."""

    memory: TierStats
    ssd: TierStats | None
    pending_writes: int
    write_errors: int


class KVStore:
    """Chunk KV by key across tiers. Thread-safe. SSD writes and promotions run on one
    background worker thread; flush() waits for them, close() (or `with`) flushes and stops it.
    """

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.memory = MemoryTier(config.memory_budget_bytes, config.pin_memory)
        self.ssd = (
            SSDTier(
                config.ssd_path, config.ssd_budget_bytes, config.model_fingerprint, config.direct_io
            )
            if config.ssd_path is not None
            else None
        )
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending: set[str] = set()  # keys queued for an SSD write
        self._write_errors = 0
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = threading.Thread(
            target=self._work, name="kv-store-worker", daemon=True
        )
        self._worker.start()

    def lookup(self, keys: Sequence[str]) -> list[str | None]:
        """Where each key is ("memory", "ssd" or None), from the indexes only: no I/O, no
        recency change, no hit counted. An "ssd" entry can still turn out bad when read."""
        tiers: list[str | None] = []
        for key in keys:
            if key in self.memory:
                tiers.append(self.memory.name)
            elif self.ssd is not None and key in self.ssd:
                tiers.append(self.ssd.name)
            else:
                tiers.append(None)
        return tiers

    def put(self, key: str, kv: ChunkKV) -> None:
        """Store `kv` in memory now and on SSD in the background (see flush()). The store keeps
        the tensors it is given (moved to host): do not modify them afterwards.
        Raises ValueError for an unsupported dtype, an empty chunk or a malformed key, and
        RuntimeError after close()."""
        if self._worker is None:
            raise RuntimeError("KVStore.put after close()")
        if kv.keys.dtype not in kvformat.supported_dtypes() or kv.num_tokens == 0:
            raise ValueError(f"cannot store {kv.keys.dtype} KV of {kv.num_tokens} tokens")
        if self.ssd is not None:
            self.ssd.file_path(key)  # validates the key before anything is stored
        host = ChunkKV(keys=kv.keys.detach().cpu(), values=kv.values.detach().cpu())
        self.memory.put(key, host)
        if self.ssd is None or key in self.ssd:
            return  # keys are content hashes: an entry on SSD already holds these tensors
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
        self._jobs.put(lambda: self._write(key, host))

    def flush(self) -> None:
        """Block until every SSD write and promotion queued so far is done (a failed write is
        counted in `write_errors`). Returns at once after close()."""
        if self._worker is not None:
            self._jobs.join()

    def open_stream(
        self,
        keys: Sequence[str | None],
        device: torch.device | str = "cpu",
        read_delay_s: float = 0.0,
        lookahead: int | None = None,
    ) -> KVLayerStream:
        """A LayerStream over `keys`; a key in no tier (or bad on SSD), or None, is simply not
        present.

        Every SSD entry the stream reads completely is promoted to memory in the background
        (`flush()` waits for it): its read buffer becomes the memory-tier entry without a second
        read (copied once into pinned memory when pin_memory). A corrupt layer mid-stream makes
        `layer(i)` raise KVStreamError and deletes the entry.
        `read_delay_s` is slept once per layer inside its load (tests and benchmarks).
        """
        sources: list[LayerSource | None] = []
        for key in keys:
            kv = self.memory.get(key) if key is not None else None
            if key is None:
                sources.append(None)
            elif kv is not None:
                sources.append(MemorySource(key, kv))
            elif self.ssd is not None:
                sources.append(self.ssd.open_entry(key))
            else:
                sources.append(None)
        return KVLayerStream(
            sources,
            device=device,
            lookahead=self.config.lookahead if lookahead is None else lookahead,
            read_delay_s=read_delay_s,
            on_complete=self._promote,
            on_error=self._stream_failed,
        )

    def stats(self) -> StoreStats:
        """A snapshot of the counters; see docs/kvstore.md for what each one counts."""
        with self._lock:
            pending, errors = len(self._pending), self._write_errors
        return StoreStats(
            memory=self.memory.stats(),
            ssd=self.ssd.stats() if self.ssd is not None else None,
            pending_writes=pending,
            write_errors=errors,
        )

    def check(self, verify_data: bool = False) -> CheckReport:
        """Reconcile the SSD index with its folder (see SSDTier.check); pending writes first."""
        self.flush()
        return self.ssd.check(verify_data) if self.ssd is not None else CheckReport()

    def drop_page_cache(self) -> None:
        """Evict the SSD files from the OS page cache, for cold-read benchmarks."""
        if self.ssd is not None:
            self.ssd.drop_page_cache()

    def close(self) -> None:
        """Flush pending work and stop the worker thread. Idempotent."""
        if self._worker is not None:
            self.flush()
            self._jobs.put(None)
            self._worker.join()
            self._worker = None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # a failed job must not stop the worker
                logger.exception("KV store background job failed")
            finally:
                self._jobs.task_done()

    def _write(self, key: str, kv: ChunkKV) -> None:
        assert self.ssd is not None
        try:
            self.ssd.put(key, kv)
        except Exception:  # a failed write leaves the entry memory-only, never a crash
            logger.exception("SSD write of %s failed", key)
            with self._lock:
                self._write_errors += 1
        finally:
            with self._lock:
                self._pending.discard(key)

    def _promote(self, sources: list[LayerSource]) -> None:
        # Called on the loader thread: pinning a large entry takes a while, so the worker does it.
        for source in sources:
            if isinstance(source, SSDEntryReader):
                kv = source.chunk_kv()
                if kv is not None:
                    self._jobs.put(functools.partial(self._admit, source.key, kv))

    def _admit(self, key: str, kv: ChunkKV) -> None:
        self.memory.put(key, kv)

    def _stream_failed(self, key: str, error: BaseException) -> None:
        if self.ssd is not None and is_entry_fault(error):
            self.ssd.report_corrupt(key, error)
