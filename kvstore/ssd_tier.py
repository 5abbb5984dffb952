"""The SSD tier: one file per chunk key under a byte budget with LRU eviction, crash-safe writes
(temp file, fsync, rename) and per-layer direct-I/O reads with checksums."""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore import codec, tiers
from kvstore import format as kvformat
from kvstore.entry_reader import EntryReader
from kvstore.errors import KVCorruptError, KVEntryError
from kvstore.types import ChunkKV, TierStats, is_valid_key, validate_key

logger = logging.getLogger(__name__)

_TEMP_RE = re.compile(r"\.(?P<key>[0-9A-Za-z_-]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp")
_SUFFIX = ".kv"


@dataclass
class CheckReport:
    """What `check()` repaired while reconciling the index with the folder."""

    removed_temp_files: int = 0
    dropped_missing: int = 0  # in the index, but the file was gone
    adopted_files: int = 0  # a valid file the index did not know (e.g. another process wrote it)
    removed_corrupt: int = 0


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor whose data starts on an ALIGN boundary, as O_DIRECT requires."""
    raw = torch.empty(nbytes + kvformat.ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % kvformat.ALIGN
    return raw[skip : skip + nbytes]


def _pread_into(fd: int, block: torch.Tensor, offset: int) -> None:
    # preadv, not pread: pread returns a fresh unaligned bytes object, which O_DIRECT refuses
    # and which would cost one more copy.
    view = block.numpy().data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise KVCorruptError(f"file ends at byte {offset + done}, {len(view) - done} short")
        done += n


def _is_stale_temp(name: str) -> bool:
    """A temp file whose writer process is gone (ours are always live: a writer may be busy)."""
    match = _TEMP_RE.fullmatch(name)
    if match is None:
        return True
    pid = int(match["pid"])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def is_entry_fault(error: BaseException) -> bool:
    """Whether `error` condemns the entry itself (delete it), not the process (e.g. EMFILE)."""
    return isinstance(error, KVEntryError) or (
        isinstance(error, OSError) and error.errno in (errno.EIO, errno.ENODATA)
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SSDEntryReader(EntryReader):
    """An open entry file: each layer is one pread (O_DIRECT where allowed) into the buffer."""

    tier = tiers.SSD

    def __init__(
        self, key: str, fd: int, header: kvformat.EntryHeader, header_bytes: bytes
    ) -> None:
        super().__init__(key, header, header_bytes)
        self._fd: int | None = fd

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes)

    def _fetch(self, layer: int, block: torch.Tensor) -> None:
        assert self._fd is not None, "reader is closed"
        _pread_into(self._fd, block, self.header.layer_offset(layer))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SSDTier:
    """Entries as files `<path>/<key[:2]>/<key>.kv`, LRU by bytes under `budget_bytes`.

    The LRU order is persisted in each file's mtime, which the tier sets itself (a strictly
    increasing nanosecond clock) on every write and every hit, so a restart rebuilds the same
    order. Every failure to read an entry is a miss: logged, counted, file deleted.
    """

    name = tiers.SSD
    promotable = True

    def __init__(
        self,
        path: str | Path,
        budget_bytes: int,
        model_fingerprint: str,
        direct_io: bool = True,
        encoding: str = "none",
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.encoding = codec.check_encoding(encoding)  # of new entries; any encoding reads
        self.path = Path(path)
        self.budget_bytes = budget_bytes
        self.model_fingerprint = model_fingerprint
        self._direct_io = direct_io and hasattr(os, "O_DIRECT")
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self._bytes = 0
        self._stats = TierStats(budget_bytes=budget_bytes)
        self._last_stamp_ns = 0
        self._lock = threading.RLock()
        self.path.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    @property
    def direct_io(self) -> bool:
        """Whether reads use O_DIRECT (turned off for good once the filesystem refuses it)."""
        return self._direct_io

    # -- lookups ---------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def keys_lru_first(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def file_path(self, key: str) -> Path:
        validate_key(key)
        return self.path / key[:2] / f"{key}{_SUFFIX}"

    def open(self, key: str) -> SSDEntryReader | None:
        """An open reader with a verified header (a hit, now most recently used), or None on a
        miss; a bad entry is logged, counted as corrupt and deleted. Caller closes the reader."""
        path = self.file_path(key)
        with self._lock:
            if key not in self._index:
                self._stats.misses += 1
                return None
        try:
            fd, header, header_bytes = self._open_verified(path, key)
        except FileNotFoundError:
            logger.warning("SSD entry %s vanished behind the index; a miss", key)
            with self._lock:
                self._forget(key)
                self._stats.misses += 1
            return None
        except (KVEntryError, OSError) as exc:
            self._drop_if_faulty(key, exc)
            with self._lock:
                self._stats.misses += 1
            return None
        stamp = self._next_stamp_ns()
        with self._lock:
            self._stats.hits += 1
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(fd, ns=(stamp, stamp))  # persists the recency for a restart
        except OSError as exc:
            logger.debug("could not stamp %s: %s", path, exc)
        return SSDEntryReader(key, fd, header, header_bytes)

    def get(self, key: str) -> ChunkKV | None:
        """The whole entry, every layer checksum verified, or None on a miss (bad: deleted)."""
        reader = self.open(key)
        return None if reader is None else self._read_all(reader)

    def _drop_if_faulty(self, key: str, error: BaseException) -> None:
        if is_entry_fault(error):
            self.report_corrupt(key, error)
        else:
            logger.warning("SSD entry %s not readable now (kept): %s", key, error)

    def report_error(self, key: str, error: BaseException) -> None:
        """A read of `key` failed with `error`: the entry is deleted when it is at fault."""
        if is_entry_fault(error):
            self.report_corrupt(key, error)

    def report_corrupt(self, key: str, error: BaseException) -> None:
        """Count a bad entry, delete its file and forget it (a later lookup is a miss)."""
        logger.warning("SSD entry %s is unusable, deleting it: %s", key, error)
        with self._lock:
            self._stats.corrupt += 1
            self._forget(key)
            self._unlink(self.file_path(key))

    # -- writes ----------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> list[str]:
        """Write `kv` (host tensors) in the tier's encoding (see `write`). Raises ValueError
        for KV the encoding cannot hold (inf or NaN)."""
        return self.write(kvformat.encode_entry(key, self.model_fingerprint, kv, self.encoding))

    def write(self, entry: kvformat.EncodedEntry) -> list[str]:
        """Write `entry` crash-safely (temp file, fsync, rename, fsync dir) as most recently
        used; returns the keys evicted for room, LRU first. An entry larger than the budget is
        not written. Raises OSError when the write fails (nothing is left behind), ValueError
        for an entry of another model."""
        header, key = entry.header, entry.key
        if header.model_fingerprint != self.model_fingerprint:
            raise ValueError(f"entry {key} is of another model")
        path = self.file_path(key)
        if header.file_size > self.budget_bytes:
            logger.info("entry %s (%d bytes) is over the SSD budget", key, header.file_size)
            return []
        if not path.parent.is_dir():
            path.parent.mkdir(exist_ok=True)
            _fsync_dir(self.path)
        temp = path.parent / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            kvformat.write_entry(fd, entry)
            stamp = self._next_stamp_ns()
            os.utime(fd, ns=(stamp, stamp))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._unlink(temp)
            raise
        os.close(fd)
        with self._lock:
            # Renamed under the lock so that an eviction never deletes a file newer than its index.
            os.replace(temp, path)
            self._forget(key)
            self._index[key] = header.file_size
            self._bytes += header.file_size
            evicted = self._evict_to_budget()
        try:
            _fsync_dir(path.parent)
        except OSError as exc:  # the entry is complete and visible; only its durability is open
            logger.warning("fsync of %s after writing %s failed: %s", path.parent, key, exc)
        return evicted

    def discard(self, key: str) -> bool:
        """Delete the entry's file and forget it; whether the index knew it."""
        with self._lock:
            known = self._forget(key)
            self._unlink(self.file_path(key))
            return known

    # -- maintenance -----------------------------------------------------------------------

    def drop_page_cache(self, key: str | None = None) -> None:
        """Ask the kernel to drop cached pages of one entry (or all) for cold-read benchmarks."""
        keys = [key] if key is not None else self.keys_lru_first()
        for k in keys:
            try:
                fd = os.open(self.file_path(k), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def check(self, verify_data: bool = False) -> CheckReport:
        """Reconcile index and folder: remove stale temp files, forget entries whose file is
        gone, adopt valid files the index lacks, delete bad ones; with `verify_data`, also read
        every layer and verify its checksum."""
        report = CheckReport()
        with self._lock:
            on_disk = self._scan(report)
            for key in [k for k in self._index if k not in on_disk]:
                logger.warning("SSD entry %s is in the index but its file is gone", key)
                self._forget(key)
                report.dropped_missing += 1
            for key, (_, size) in sorted(on_disk.items(), key=lambda item: item[1][0]):
                if key not in self._index:
                    self._index[key] = size
                    self._bytes += size
                    report.adopted_files += 1
            self._evict_to_budget()
        if verify_data:
            for key in self.keys_lru_first():
                if not self._verify_data(key):
                    report.removed_corrupt += 1
        return report

    def stats(self) -> TierStats:
        with self._lock:
            self._stats.entries, self._stats.bytes = len(self._index), self._bytes
            return TierStats(**vars(self._stats))

    def close(self) -> None:
        """Nothing to release: every reader closes its own file."""

    # -- internals -------------------------------------------------------------------------

    def _rebuild(self) -> None:
        with self._lock:
            on_disk = self._scan(CheckReport())
            for key, (_, size) in sorted(on_disk.items(), key=lambda item: (item[1][0], item[0])):
                self._index[key] = size
                self._bytes += size
            evicted = self._evict_to_budget()
        logger.info(
            "SSD tier %s: %d entries, %d bytes (%d evicted to fit the budget)",
            self.path,
            len(self._index),
            self._bytes,
            len(evicted),
        )

    def _scan(self, report: CheckReport) -> dict[str, tuple[int, int]]:
        """Valid entry files on disk -> (mtime_ns, size); removes stale temps and bad files."""
        found: dict[str, tuple[int, int]] = {}
        for sub in sorted(p for p in self.path.iterdir() if p.is_dir() and len(p.name) == 2):
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    if _is_stale_temp(entry.name):
                        logger.info("removing stale temp file %s", entry.path)
                        self._unlink(Path(entry.path))
                        report.removed_temp_files += 1
                    continue
                if not entry.name.endswith(_SUFFIX):
                    continue
                key = entry.name[: -len(_SUFFIX)]
                if not is_valid_key(key) or key[:2] != sub.name:
                    continue  # not a name this tier writes; leave foreign files alone
                known_size = self._index.get(key)
                try:
                    stat = entry.stat()
                    if known_size != stat.st_size:  # unknown or changed: verify its header
                        fd, _, _ = self._open_verified(Path(entry.path), key)
                        os.close(fd)
                except FileNotFoundError:
                    continue
                except (KVEntryError, OSError) as exc:
                    if not is_entry_fault(exc):
                        logger.warning("SSD entry file %s not readable now: %s", entry.path, exc)
                        continue
                    logger.warning("SSD entry file %s is unusable, deleting: %s", entry.path, exc)
                    self._stats.corrupt += 1
                    report.removed_corrupt += 1
                    self._forget(key)
                    self._unlink(Path(entry.path))
                    continue
                found[key] = (stat.st_mtime_ns, stat.st_size)
        return found

    def _open_verified(self, path: Path, key: str) -> tuple[int, kvformat.EntryHeader, bytes]:
        """An fd (O_DIRECT where the filesystem allows), the verified header of `path` and the
        header's bytes."""
        fd = self._open_read(path)
        try:
            probe = aligned_empty(kvformat.ALIGN)
            try:
                _pread_into(fd, probe, 0)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self._direct_io:
                    raise
                # The filesystem took O_DIRECT at open but refuses the read: stop using it.
                logger.info("direct I/O unsupported under %s; using buffered reads", self.path)
                self._direct_io = False
                os.close(fd)
                fd = self._open_read(path)
                _pread_into(fd, probe, 0)
            block = probe
            data_offset = kvformat.header_size(probe.numpy().data)
            if data_offset > os.fstat(fd).st_size:
                raise KVCorruptError(f"file shorter than its {data_offset}-byte header")
            if data_offset > kvformat.ALIGN:
                block = aligned_empty(data_offset)
                _pread_into(fd, block, 0)
            header_bytes = bytes(block.numpy().data[:data_offset])
            header = kvformat.parse_header(header_bytes, self.model_fingerprint, key)
            size = os.fstat(fd).st_size
            if size != header.file_size:
                raise KVCorruptError(f"file has {size} bytes, its header says {header.file_size}")
        except BaseException:
            os.close(fd)
            raise
        return fd, header, header_bytes

    def _open_read(self, path: Path) -> int:
        if self._direct_io:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                logger.info("O_DIRECT refused under %s (e.g. tmpfs); buffered reads", self.path)
                self._direct_io = False
        return os.open(path, os.O_RDONLY)

    def _verify_data(self, key: str) -> bool:
        """Read and verify every layer; False when the entry was bad (and is deleted now)."""
        try:
            fd, header, header_bytes = self._open_verified(self.file_path(key), key)
        except FileNotFoundError:
            self.discard(key)
            return True
        except (KVEntryError, OSError) as exc:
            self._drop_if_faulty(key, exc)
            return not is_entry_fault(exc)
        return self._read_all(SSDEntryReader(key, fd, header, header_bytes)) is not None

    def _read_all(self, reader: SSDEntryReader) -> ChunkKV | None:
        """Every layer of an open entry, then closes it; None (entry dropped) when bad."""
        try:
            for layer in range(reader.num_layers):
                reader.read_layer(layer)
        except (KVEntryError, OSError) as exc:
            self._drop_if_faulty(reader.key, exc)
            return None
        finally:
            reader.close()
        return reader.chunk_kv()

    def _evict_to_budget(self) -> list[str]:
        evicted = []
        while self._bytes > self.budget_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._stats.evictions += 1
            self._unlink(self.file_path(key))
            evicted.append(key)
        return evicted

    def _forget(self, key: str) -> bool:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size
        return size is not None

    def _next_stamp_ns(self) -> int:
        with self._lock:
            self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
            return self._last_stamp_ns

    @staticmethod
    def _unlink(path: Path) -> None:
        path.unlink(missing_ok=True)
