"""The KV store facade the engine uses: an ordered list of tiers (gpu, host memory, SSD, Redis),
write-through to SSD and Redis on a background worker thread, and layer streams over them all."""

from __future__ import annotations

import errno
import functools
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore import format as kvformat
from kvstore import tiers
from kvstore.entry_reader import EntryReader
from kvstore.errors import KVEntryError
from kvstore.eviction import POLICIES, PolicyName
from kvstore.loader import KVLayerStream, Loader
from kvstore.memory_tier import MemoryTier
from kvstore.remote_tier import RemoteTier, RemoteTierError
from kvstore.ssd_tier import CheckReport, SSDTier
from kvstore.tiers import LayerSource, MemorySource, PersistentTier, Tier
from kvstore.types import ChunkKV, TierStats, validate_key

logger = logging.getLogger(__name__)

# Keys whose host-memory hits are counted towards gpu promotion, at most; the least recently
# hit is forgotten first (a counter also goes when its entry leaves host memory).
HOST_HITS_MAX_KEYS = 65_536


@dataclass(frozen=True)
class KVStoreConfig:
    """Budgets in bytes; `ssd_path=None` keeps the store off local disk.

    `gpu_budget_bytes > 0` adds the gpu tier on `device` ahead of host memory: entries that
    hit `gpu_promote_hits` times in host memory are copied there, and the exact prefix cache
    lives there. On the CPU the host tier plays that role, so the engine leaves it at 0.
    `remote_url` (redis:// or rediss://) adds the remote tier after SSD, shared by every
    engine; `remote_timeout_s` bounds each Redis connect and read. `memory_policy` is the
    eviction policy of host memory and the gpu tier (kvstore/eviction.py).
    """

    model_fingerprint: str
    memory_budget_bytes: int = 2 * 1024**3
    ssd_path: str | Path | None = None
    ssd_budget_bytes: int = 64 * 1024**3
    pin_memory: bool = False  # set when the engine runs on CUDA
    lookahead: int = 2
    direct_io: bool = True  # O_DIRECT reads where the filesystem supports them
    gpu_budget_bytes: int = 0
    device: str = "cpu"
    gpu_promote_hits: int = 2
    # How the store encodes the entries it writes to every persistent tier, SSD and remote
    # (codec.ENCODINGS); entries of any encoding read back.
    persistent_encoding: str = "none"
    remote_url: str | None = field(default=None, repr=False)  # may hold a password
    remote_timeout_s: float = 0.5
    # W-TinyLFU keeps warm chunks through a stream of one-off ones; lru for an exact recency
    # order (bench/results/cache_churn.md measures both).
    memory_policy: PolicyName = "tinylfu"
    # On the CPU, stream each layer through the staging copy a GPU's layers take (one copy call
    # per layer into a staging slab, then one more): tests and benchmarks see that path's cost
    # and its locking without a GPU. Off the CPU layers are always staged.
    stage_kv: bool = False

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        budgets = (self.memory_budget_bytes, self.ssd_budget_bytes, self.gpu_budget_bytes)
        if min(*budgets, self.lookahead) < 0 or self.gpu_promote_hits < 1:
            raise ValueError(f"budgets and lookahead must be >= 0, gpu_promote_hits >= 1: {self}")
        if self.memory_policy not in POLICIES:
            raise ValueError(f"memory_policy must be one of {POLICIES}, got {self.memory_policy!r}")


@dataclass
class StoreStats:
    """Counters per tier, fastest first, and the state of the background writes by persistent
    tier: `write_errors_by_tier` counts failed writes, `last_write_error_by_tier` says why a
    tier's latest write failed (e.g. "ENOSPC: No space left on device", never a path), None
    once a write to it succeeds again."""

    tiers: dict[str, TierStats]
    pending_writes: int
    write_errors_by_tier: dict[str, int] = field(default_factory=dict)
    last_write_error_by_tier: dict[str, str | None] = field(default_factory=dict)

    def tier(self, name: str) -> TierStats | None:
        return self.tiers.get(name)

    @property
    def write_errors(self) -> int:
        """Failed writes to every persistent tier together."""
        return sum(self.write_errors_by_tier.values())

    @property
    def last_write_error(self) -> str | None:
        """Why the latest write to the first failing persistent tier (SSD before remote)
        failed, or None when every tier's last write succeeded."""
        return next((e for e in self.last_write_error_by_tier.values() if e is not None), None)


def _describe(error: BaseException) -> str:
    """The error's kind without the file names an OSError carries."""
    if isinstance(error, RemoteTierError):
        return str(error)  # names the failure and Redis's address, never a path or a password
    if isinstance(error, OSError) and error.errno is not None:
        return f"{errno.errorcode.get(error.errno, error.errno)}: {error.strerror}"
    return type(error).__name__


class KVStore:
    """Chunk KV by key across an ordered list of tiers (kvstore.tiers.ORDER). Thread-safe.

    `put` stores in host memory at once and writes through to the persistent tiers (SSD,
    remote) on one background worker thread, which also does promotions; flush() waits for
    them, close() (or `with`) flushes and stops it.
    """

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self._memory = MemoryTier(
            config.memory_budget_bytes, config.pin_memory, policy=config.memory_policy
        )
        self._gpu = (
            MemoryTier(
                config.gpu_budget_bytes,
                name=tiers.GPU,
                device=config.device,
                policy=config.memory_policy,
            )
            if config.gpu_budget_bytes > 0
            else None
        )
        self._ssd = (
            SSDTier(
                config.ssd_path,
                config.ssd_budget_bytes,
                config.model_fingerprint,
                config.direct_io,
                config.persistent_encoding,
            )
            if config.ssd_path is not None
            else None
        )
        remote = (
            RemoteTier(
                config.remote_url,
                config.model_fingerprint,
                config.persistent_encoding,
                config.remote_timeout_s,
            )
            if config.remote_url is not None
            else None
        )
        # Written through in this order, each from one encode of the entry.
        self._persistent: list[PersistentTier] = [t for t in (self._ssd, remote) if t is not None]
        present: list[Tier | None] = [self._gpu, self._memory, *self._persistent]
        self.tiers: list[Tier] = sorted(
            (t for t in present if t is not None), key=lambda t: tiers.rank(t.name)
        )
        self.loader = Loader(f"kv-loader-{id(self):x}")  # one thread for every stream
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending: dict[str, Future[bool]] = {}  # keys queued for a write-through
        # Host-memory hits of keys not yet on the gpu, least recently hit first.
        self._host_hits: OrderedDict[str, int] = OrderedDict()
        self._write_errors = {t.name: 0 for t in self._persistent}
        self._last_write_error: dict[str, str | None] = {t.name: None for t in self._persistent}
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = threading.Thread(
            target=self._work, name="kv-store-worker", daemon=True
        )
        self._worker.start()

    def tier(self, name: str) -> Tier | None:
        """The tier called `name` (a kvstore.tiers constant), or None when not configured."""
        return next((t for t in self.tiers if t.name == name), None)

    def lookup(self, keys: Sequence[str], remote: bool = True) -> list[str | None]:
        """Where each key is (the fastest tier holding it, or None), from the local indexes (no
        I/O) and, for keys no local tier has, Redis asked once for all of them (none while
        Redis is unreachable, or without `remote`); no recency change, no hit counted. An entry
        can still turn out bad when read."""
        local = [t for t in self.tiers if not isinstance(t, RemoteTier)]
        found = [next((t.name for t in local if key in t), None) for key in keys]
        shared = self.tier(tiers.REMOTE)
        if remote and isinstance(shared, RemoteTier):
            missed = [j for j, name in enumerate(found) if name is None]
            present = shared.contains_many([keys[j] for j in missed])
            for j, there in zip(missed, present, strict=True):
                found[j] = tiers.REMOTE if there else None
        return found

    def put(self, key: str, kv: ChunkKV) -> Future[bool]:
        """Store `kv` in host memory now and in the SSD and remote tiers in the background (see
        flush()). The store keeps the tensors it is given (moved to host): do not modify them
        afterwards. A tier that has the key already is not written again (keys are content
        hashes).

        The future is done once every write-through is (so the entry is in Redis, when Redis
        is up, by then). It is True when the entry is in the first persistent tier (SSD when
        there is one, else remote, else memory), False when it could not be written there (a
        failed write, counted in `write_errors_by_tier`; an entry over the tier's budget). A
        failed write to remote alone is counted, not reported here: the entry is on SSD.
        Raises ValueError for an unsupported dtype, an empty chunk or a malformed key, and
        RuntimeError after close()."""
        if self._worker is None:
            raise RuntimeError("KVStore.put after close()")
        if kv.keys.dtype not in kvformat.supported_dtypes() or kv.num_tokens == 0:
            raise ValueError(f"cannot store {kv.keys.dtype} KV of {kv.num_tokens} tokens")
        validate_key(key)
        host = ChunkKV(keys=kv.keys.detach().cpu(), values=kv.values.detach().cpu())
        self._put_host(key, host)
        written: Future[bool] = Future()
        if not self._persistent:
            written.set_result(key in self._memory)
            return written
        if self._ssd is not None and self._persistent == [self._ssd] and key in self._ssd:
            written.set_result(True)  # keys are content hashes: the entry holds these tensors
            return written
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                return pending
            self._pending[key] = written
        self._jobs.put(lambda: self._write(key, host, written))
        return written

    def put_local(self, key: str, kv: ChunkKV) -> bool:
        """Keep `kv` in the fastest tier only (gpu, else host memory), never written through:
        for entries cheap to rebuild, like an exact prompt prefix. Whether it was kept."""
        validate_key(key)
        fastest = self.tiers[0]
        fastest.put(key, kv)
        return key in fastest

    def get_local(self, key: str) -> ChunkKV | None:
        """An entry of the fastest tier (as put_local left it), now most recently used."""
        fastest = self.tiers[0]
        assert isinstance(fastest, MemoryTier)
        return fastest.get(key)

    def flush(self) -> None:
        """Block until every write-through and promotion queued so far is done (a failed write
        is counted in `write_errors_by_tier`). Returns at once after close()."""
        if self._worker is not None:
            self._jobs.join()

    def open_stream(
        self,
        keys: Sequence[str | None],
        device: torch.device | str = "cpu",
        read_delay_s: float = 0.0,
        lookahead: int | None = None,
        first_layer: int = 0,
        parked: bool = False,
    ) -> KVLayerStream:
        """A LayerStream over `keys`, each served by the fastest tier that has it; a key in no
        tier (or bad on SSD or remote), or None, is simply not present. Layers below
        `first_layer` are never loaded; `parked`: none until the stream's `start()`. The keys
        the local tiers miss are looked up in the remote tier in one pipelined round trip.

        Every SSD or remote entry the stream read, completely or in part, is promoted to host
        memory in the background (`flush()` waits for it): the layers not read yet are read by
        the store's worker, and the read buffer becomes the host entry without a second read
        (copied once into pinned memory when pin_memory); a remote entry is also written to
        SSD. A key hit `gpu_promote_hits` times in host memory is copied to the gpu tier in the
        background. A corrupt layer mid-stream makes `layer(i)` raise KVStreamError and
        deletes the entry; a remote entry evicted or a Redis failure mid-stream raises it too.
        `read_delay_s` is slept once per layer inside its load (tests and benchmarks).
        """
        sources: list[LayerSource | None] = []
        for key in keys:
            source = None
            if key is not None:
                for tier in self.tiers:
                    if isinstance(tier, RemoteTier):
                        break  # below, for every key the local tiers miss at once
                    source = tier.open(key)
                    if source is not None:
                        break
            if source is not None and source.tier == tiers.MEMORY:
                self._count_host_hit(source)
            sources.append(source)
        remote = self.tier(tiers.REMOTE)
        if isinstance(remote, RemoteTier):
            missed = {
                j: key
                for j, (key, source) in enumerate(zip(keys, sources, strict=True))
                if key is not None and source is None
            }
            readers = remote.open_many(list(missed.values()))
            for j, reader in zip(missed, readers, strict=True):
                sources[j] = reader
        return KVLayerStream(
            sources,
            device=device,
            lookahead=self.config.lookahead if lookahead is None else lookahead,
            read_delay_s=read_delay_s,
            on_finish=self._finish_stream,
            on_error=self._stream_failed,
            first_layer=first_layer,
            coalesce=True if self.config.stage_kv else None,
            loader=self.loader,
            parked=parked,
        )

    def stats(self) -> StoreStats:
        """A snapshot of the counters; see docs/kvstore.md for what each one counts."""
        with self._lock:
            pending, errors, last_errors = (
                len(self._pending),
                dict(self._write_errors),
                dict(self._last_write_error),
            )
        return StoreStats(
            tiers={t.name: t.stats() for t in self.tiers},
            pending_writes=pending,
            write_errors_by_tier=errors,
            last_write_error_by_tier=last_errors,
        )

    def check(self, verify_data: bool = False) -> CheckReport:
        """Reconcile the SSD index with its folder (see SSDTier.check); pending writes first."""
        self.flush()
        return self._ssd.check(verify_data) if self._ssd is not None else CheckReport()

    def drop_page_cache(self) -> None:
        """Evict the SSD files from the OS page cache, for cold-read benchmarks."""
        if self._ssd is not None:
            self._ssd.drop_page_cache()

    def close(self) -> None:
        """Flush pending work and stop the worker thread. Idempotent."""
        if self._worker is not None:
            self.loader.stop()
            self.flush()
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
            for tier in self.tiers:
                tier.close()

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

    def _write(self, key: str, kv: ChunkKV, written: Future[bool]) -> None:
        encode = functools.cache(
            lambda: kvformat.encode_entry(
                key, self.config.model_fingerprint, kv, self.config.persistent_encoding
            )
        )
        try:
            outcomes = [self._write_to(tier, key, encode) for tier in self._persistent]
        finally:
            with self._lock:
                self._pending.pop(key, None)
        written.set_result(outcomes[0])

    def _write_to(
        self, tier: PersistentTier, key: str, entry: Callable[[], kvformat.EncodedEntry]
    ) -> bool:
        """Write `entry()` to one persistent tier unless it has the key; whether it has it now.
        `entry` encodes on its first call, so a tier holding the key costs no encode."""
        try:
            if key in tier:
                return True  # keys are content hashes: the entry holds these tensors
            tier.write(entry())
        except Exception as exc:  # a failed write leaves the entry where it was, never a crash
            if isinstance(exc, RemoteTierError):  # the breaker logs Redis going down
                logger.debug("%s write of %s failed: %s", tier.name, key, exc)
            else:
                logger.exception("%s write of %s failed", tier.name, key)
            with self._lock:
                self._write_errors[tier.name] += 1
                if not isinstance(exc, RemoteTierError) or exc.answered:
                    # An unreachable Redis is the tier's state, not a failing write.
                    self._last_write_error[tier.name] = _describe(exc)
            return False
        with self._lock:
            self._last_write_error[tier.name] = None
        return key in tier  # not there: over the tier's budget, or evicted at once

    def _count_host_hit(self, source: LayerSource) -> None:
        if self._gpu is None or source.key in self._gpu:
            return
        with self._lock:
            hits = self._host_hits.pop(source.key, 0) + 1
            if hits < self.config.gpu_promote_hits:
                self._host_hits[source.key] = hits  # now the most recently hit
                while len(self._host_hits) > HOST_HITS_MAX_KEYS:
                    self._host_hits.popitem(last=False)
                return
        assert isinstance(source, MemorySource)
        self._jobs.put(functools.partial(self._admit, self._gpu, source.key, source.kv))

    def _finish_stream(self, sources: list[LayerSource], layers_read: set[int]) -> None:
        # Called on the loader thread, which must stay quick: reading the rest of an entry and
        # pinning it take a while, so the worker does them (and closes those readers).
        for source in sources:
            tier = self.tier(source.tier)
            if (
                tier is not None
                and tier.promotable
                and isinstance(source, EntryReader)
                and layers_read
                and self._worker is not None
                and self._worth_promoting(source)
            ):
                self._jobs.put(functools.partial(self._promote, source, set(layers_read)))
            else:
                source.close()

    def _faster_persistent(self, tier: str) -> list[PersistentTier]:
        """The persistent tiers ahead of `tier` (SSD for a remote entry)."""
        return [t for t in self._persistent if tiers.rank(t.name) < tiers.rank(tier)]

    def _worth_promoting(self, reader: EntryReader) -> bool:
        """Whether a faster tier can keep the whole entry: host memory, or a persistent one."""
        fits = reader.header.chunk_nbytes <= self._memory.budget_bytes
        return fits or bool(self._faster_persistent(reader.tier))

    def _promote(self, reader: EntryReader, layers_read: set[int]) -> None:
        """Complete the read of a promotable entry and copy it to the faster tiers: decoded to
        host memory, as stored (no encode) to a faster persistent tier, for the next restart."""
        try:
            for layer in range(reader.num_layers):
                if layer not in layers_read:
                    reader.read_layer(layer)
            kv, stored = reader.chunk_kv(), reader.stored_entry()
        except (KVEntryError, OSError) as exc:
            self._stream_failed(reader, exc)
            return
        finally:
            reader.close()
        if kv is None or stored is None:
            return
        if kv.nbytes <= self._memory.budget_bytes:
            self._put_host(reader.key, kv)
        for tier in self._faster_persistent(reader.tier):
            self._write_to(tier, reader.key, lambda: stored)

    @staticmethod
    def _admit(tier: MemoryTier, key: str, kv: ChunkKV) -> None:
        tier.put(key, kv)

    def _put_host(self, key: str, kv: ChunkKV) -> None:
        """Keep `kv` in host memory; the entries it evicts there lose their hit counts (a key
        back later starts again from 0); HOST_HITS_MAX_KEYS bounds them whatever happens."""
        evicted = self._memory.put(key, kv)
        if evicted and self._gpu is not None:
            with self._lock:
                for victim in evicted:
                    self._host_hits.pop(victim, None)

    def _stream_failed(self, source: LayerSource, error: BaseException) -> None:
        """A read of `source` failed: its tier deletes the entry if the entry is at fault."""
        tier = self.tier(source.tier)
        if tier is not None:
            tier.report_error(source.key, error)
