"""The remote tier: chunk KV in Redis, shared by every engine, in the SSD format's header and
per-layer checksums, behind a circuit breaker so that a Redis down or slow costs only a miss."""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.typing import EncodableT, FieldT

from kvstore import codec, tiers
from kvstore import format as kvformat
from kvstore.entry_reader import EntryReader
from kvstore.errors import KVCorruptError, KVEntryError
from kvstore.types import ChunkKV, TierStats, validate_key

logger = logging.getLogger(__name__)

PREFIX = "ragblend:kv:"
HEADER_FIELD = "h"  # the header's field in an entry's hash; layer i is the field str(i)
# A random id per write, read with the header and with every layer: a read whose fields carry
# two ids saw two writes (a rewrite after eviction, or in another encoding) and is a miss.
WRITE_FIELD = "w"
SCHEMES = ("redis", "rediss")
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0

OK = "ok"
UNREACHABLE = "unreachable"

T = TypeVar("T")


class RemoteTierError(OSError):
    """A Redis operation failed or was not tried (the tier is backing off); the message names
    the kind of failure, never the URL's password. The stream loader treats it as an I/O error.
    `answered`: Redis was reached and refused the command (e.g. OOM under `noeviction`), as
    opposed to being unreachable, slow or skipped."""

    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class RemoteEntryGoneError(KVEntryError):
    """An entry's layer vanished after its header was read (Redis evicted the entry): a miss.
    `partial`: the entry is still there without that layer (written by an earlier version,
    which wrote header and layers apart): the read that finds it deletes it."""

    def __init__(self, message: str, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial


class RemoteEntryRewrittenError(KVEntryError):
    """The entry was written again after its header was read: a miss, the new entry kept."""


def check_url(url: str) -> str:
    """`url` when it is a redis:// or rediss:// URL with a host, else ValueError (the password,
    if any, left out of the message)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise ValueError(
            f"{redact_url(url)!r} is not a Redis URL: use redis://host:port/db or rediss://..."
        )
    try:
        parts.port  # noqa: B018 - parsing it is the check: a port out of range raises
    except ValueError as exc:
        raise ValueError(f"{redact_url(url)!r} has a bad port") from exc
    return url


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by ***, for logs and /health."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _describe(error: BaseException) -> str:
    """The kind of a Redis failure; redis-py's messages name host and port, never a password."""
    return f"{type(error).__name__}: {error}"


class RemoteEntryReader(EntryReader):
    """An entry in Redis: each layer is one HMGET of the layer and the write id, copied once
    into the buffer."""

    tier = tiers.REMOTE

    def __init__(
        self,
        owner: RemoteTier,
        key: str,
        header: kvformat.EntryHeader,
        header_bytes: bytes,
        write_id: bytes | None,
    ) -> None:
        super().__init__(key, header, header_bytes)
        self._owner = owner
        self._write_id = write_id  # None: written by a version without write ids

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _fetch(self, layer: int, block: torch.Tensor) -> None:
        """RemoteTierError when Redis fails, RemoteEntryRewrittenError when the entry was
        written again since its header was read, RemoteEntryGoneError when it was evicted
        meanwhile, KVCorruptError when the value's length is wrong."""
        raw, write_id = self._owner.get_layer(self.key, layer)
        if write_id != self._write_id and write_id is not None:
            raise RemoteEntryRewrittenError(f"{self.key} was written again while being read")
        if raw is None:
            partial = write_id is not None or self._write_id is None
            raise RemoteEntryGoneError(f"layer {layer} of {self.key} is gone (evicted)", partial)
        expected = kvformat.layer_nbytes(self.header)
        if len(raw) != expected:
            raise KVCorruptError(
                f"layer {layer} of {self.key} has {len(raw)} bytes, {expected} expected"
            )
        np.copyto(block[: len(raw)].numpy(), np.frombuffer(raw, dtype=np.uint8))  # one copy

    def close(self) -> None:
        """Nothing to release: each layer was one request."""


class RemoteTier:
    """Entries in Redis, one hash per entry: `ragblend:kv:<model hash>:<key>` with the header in
    field `h`, layer i in field `i` and the write's random id in field `w`, which a reader
    reads with the header and with every layer. Thread-safe (redis-py's connection pool).

    Nothing is cached locally: `key in tier` asks Redis (HEXISTS on the header). An entry is
    written by one HSET of the header and every layer, so Redis stores all of it or nothing; a
    hash with its header but not a layer (an earlier version wrote them apart) is deleted by
    the read that finds it. Entries carry no TTL: Redis evicts whole hashes under
    `maxmemory-policy allkeys-lru`, and an entry evicted while being read is a miss from that
    layer on.

    Circuit breaker: a connection error or timeout marks Redis unreachable; for a back-off
    (`backoff_s`) every operation is a miss or a failed write without asking Redis, then one
    caller (the probe) tries again: its success closes the breaker, its failure doubles the
    back-off (up to `max_backoff_s`). Calls already in flight that fail meanwhile change neither.
    """

    name = tiers.REMOTE
    promotable = True

    def __init__(
        self,
        url: str,
        model_fingerprint: str,
        encoding: str = "none",
        timeout_s: float = 0.5,
        backoff_s: float = BACKOFF_START_S,
        max_backoff_s: float = BACKOFF_MAX_S,
    ) -> None:
        if timeout_s <= 0 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(f"need timeout_s > 0, 0 < backoff_s <= max_backoff_s: {timeout_s=}")
        self.url = redact_url(check_url(url))
        self.encoding = codec.check_encoding(encoding)  # of new entries; any encoding reads
        self.model_fingerprint = model_fingerprint
        model_hash = hashlib.sha256(model_fingerprint.encode()).hexdigest()[:16]
        self._prefix = f"{PREFIX}{model_hash}:"
        # No retries inside redis-py: the breaker decides when Redis is asked again.
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        if self._client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the Redis URL must not set decode_responses: KV values are bytes")
        self._first_backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = backoff_s
        self._down_until: float | None = None  # monotonic time of the next try; None: up
        self._probing = False  # one caller is trying Redis again after the back-off
        self._last_error: str | None = None
        self._stats = TierStats(entries=None, bytes=None, budget_bytes=None)
        self._listeners: list[Callable[[str, float], None]] = []
        self._lock = threading.Lock()

    def redis_key(self, key: str) -> str:
        """The Redis key of chunk `key`'s hash."""
        return self._prefix + validate_key(key)

    def add_latency_listener(self, listener: Callable[[str, float], None]) -> None:
        """`listener(op, seconds)` is called after every Redis operation (the engine's metrics)."""
        self._listeners.append(listener)

    # -- state -----------------------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        """False while the breaker is open (the last try failed)."""
        with self._lock:
            return self._down_until is None

    @property
    def last_error(self) -> str | None:
        """Why the last failed operation failed, until one succeeds."""
        with self._lock:
            return self._last_error

    def ping(self) -> bool:
        """Whether Redis answers now (skipped, False, during a back-off)."""
        try:
            return bool(self._call("ping", self._client.ping))
        except RemoteTierError:
            return False

    # -- the Tier protocol -----------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether each entry is there, asked in one pipelined round trip (all False while
        Redis fails or the tier backs off)."""
        if not keys:
            return []
        names = [self.redis_key(key) for key in keys]

        def exist() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.hexists(name, HEADER_FIELD)
            return [bool(there) for there in pipe.execute()]

        try:
            return self._call("lookup", exist)
        except RemoteTierError:
            return [False] * len(keys)

    def open(self, key: str) -> RemoteEntryReader | None:
        """A reader with a verified header (a hit), or None: a miss, Redis failing or backing
        off, or a bad header (counted corrupt, the entry deleted)."""
        return self.open_many([key])[0]

    def open_many(self, keys: list[str]) -> list[RemoteEntryReader | None]:
        """`open` of each key, their headers read in one pipelined round trip."""
        if not keys:
            return []
        names = [self.redis_key(key) for key in keys]

        def read_headers() -> list[list[bytes | None]]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.hmget(name, [HEADER_FIELD, WRITE_FIELD])
            return cast("list[list[bytes | None]]", pipe.execute())

        try:
            found = self._call("lookup", read_headers)
        except RemoteTierError:
            found = [[None, None]] * len(keys)
        return [
            self._reader(key, raw, write_id)
            for key, (raw, write_id) in zip(keys, found, strict=True)
        ]

    def _reader(
        self, key: str, raw: bytes | None, write_id: bytes | None
    ) -> RemoteEntryReader | None:
        """The reader of `key` from its header and write id as read, or None (counted)."""
        if raw is None:
            self._count(misses=1)
            return None
        try:
            header = kvformat.parse_header(raw, self.model_fingerprint, key)
            if len(raw) != header.data_offset:
                raise KVCorruptError(f"header has {len(raw)} bytes, {header.data_offset} expected")
        except KVEntryError as exc:
            self.report_corrupt(key, exc)
            self._count(misses=1)
            return None
        self._count(hits=1)
        return RemoteEntryReader(self, key, header, raw, write_id)

    def get_layer(self, key: str, layer: int) -> tuple[bytes | None, bytes | None]:
        """Layer `layer`'s value of entry `key` (None when it is gone) and the id of the write
        that holds it, read together; RemoteTierError."""
        return self._hmget(key, str(layer), WRITE_FIELD)

    def _hmget(self, key: str, *fields: str) -> tuple[bytes | None, bytes | None]:
        """Two fields of entry `key`'s hash read at once (one command: one state of the hash)."""
        name = self.redis_key(key)
        first, second = cast(
            "list[bytes | None]", self._call("get", lambda: self._client.hmget(name, fields))
        )
        return first, second

    def get(self, key: str) -> ChunkKV | None:
        """The whole entry, every layer verified, or None (a miss; a bad entry is deleted)."""
        reader = self.open(key)
        if reader is None:
            return None
        try:
            for layer in range(reader.num_layers):
                reader.read_layer(layer)
        except (KVEntryError, OSError) as exc:
            self.report_error(key, exc)
            return None
        return reader.chunk_kv()

    def put(self, key: str, kv: ChunkKV) -> list[str]:
        """Write `kv` (host tensors) in the tier's encoding (see `write`); ValueError for KV
        the encoding cannot hold."""
        return self.write(kvformat.encode_entry(key, self.model_fingerprint, kv, self.encoding))

    def write(self, entry: kvformat.EncodedEntry) -> list[str]:
        """Write `entry`: the header, every layer and a fresh write id in one HSET, which Redis
        runs whole or refuses whole (OOM), so a failed write leaves nothing and two writers of
        one key leave one's entry, never a mix; a reader that saw the other's header finds its
        layers carry another id (a miss, the entry kept). Evicts nothing itself (Redis does);
        returns []. RemoteTierError when Redis fails or the tier is backing off, ValueError for
        an entry of another model."""
        header = entry.header
        if header.model_fingerprint != self.model_fingerprint:
            raise ValueError(f"entry {entry.key} is of another model")
        fields: dict[FieldT, EncodableT] = {
            HEADER_FIELD: entry.header_bytes,
            WRITE_FIELD: secrets.token_bytes(8),
        }
        for i, parts in enumerate(entry.layers):
            fields[str(i)] = b"".join(parts)
        name = self.redis_key(entry.key)
        self._call("put", lambda: self._client.hset(name, mapping=fields))
        nbytes = len(entry.header_bytes) + header.num_layers * kvformat.layer_nbytes(header)
        self._count(bytes_written=nbytes)
        return []

    def discard(self, key: str) -> bool:
        """Delete the entry; whether Redis had it (False when Redis cannot be asked)."""
        try:
            return bool(self._call("delete", lambda: self._client.unlink(self.redis_key(key))))
        except RemoteTierError:
            return False

    def report_error(self, key: str, error: BaseException) -> None:
        """A read of `key` failed with `error`: a bad value is counted corrupt and deleted; an
        entry written again meanwhile is a miss (the new one stays); a layer gone is a miss,
        and where the hash is still there without that layer (an earlier version's partial
        write: Redis evicts whole hashes) it is deleted too, since every lookup would report it
        present and every read fail on it; a Redis failure (already counted by the breaker)
        changes nothing."""
        if isinstance(error, RemoteEntryRewrittenError):
            logger.info("remote entry %s was written again while being read; a miss", key)
            self._count(misses=1)
        elif isinstance(error, RemoteEntryGoneError):
            logger.info("remote entry %s lost a layer while being read; a miss", key)
            self._count(misses=1)
            if error.partial:
                self.discard(key)
        elif isinstance(error, KVEntryError):
            self.report_corrupt(key, error)

    def report_corrupt(self, key: str, error: BaseException) -> None:
        """Count a bad entry and delete it (a later lookup is a miss)."""
        logger.warning("remote entry %s is unusable, deleting it: %s", key, error)
        self._count(corrupt=1)
        self.discard(key)

    def stats(self) -> TierStats:
        """Hits, misses, corrupt entries and bytes written by this process; entries, bytes and
        budget are Redis's and unknown here (None)."""
        with self._lock:
            stats = TierStats(**vars(self._stats))
            stats.reachable = self._down_until is None
            stats.last_error = self._last_error
            return stats

    def close(self) -> None:
        self._client.close()

    # -- the breaker -----------------------------------------------------------------------

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        """Run one Redis operation unless the breaker is open; a connection error or timeout
        opens it, any success closes it. Raises RemoteTierError for every failure."""
        probe = False
        with self._lock:
            if self._down_until is not None:
                if self._probing or time.monotonic() < self._down_until:
                    raise RemoteTierError(f"Redis unreachable (backing off): {self._last_error}")
                self._probing = probe = True  # this caller tries; the others still skip Redis
        start = time.perf_counter()
        try:
            result = fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._trip(exc, probe)
            raise RemoteTierError(_describe(exc)) from exc
        except redis.RedisError as exc:  # Redis answered with an error (e.g. OOM): reachable
            self._recovered(_describe(exc))
            raise RemoteTierError(_describe(exc), answered=True) from exc
        else:
            self._recovered(None)
        finally:
            if probe:  # whatever `fn` raised: a probe left set would keep the breaker open
                with self._lock:
                    self._probing = False
            seconds = time.perf_counter() - start
            for listener in self._listeners:
                listener(op, seconds)
        return result

    def _trip(self, error: BaseException, probe: bool) -> None:
        """Open the breaker for the first back-off, or, when the probe failed, for twice the
        last one; a call that was in flight when the breaker opened changes nothing but the
        last error (four calls failing together on one hung Redis back off once)."""
        with self._lock:
            was_up = self._down_until is None
            self._last_error = _describe(error)
            if not was_up and not probe:
                return
            if probe:
                self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
            self._down_until = time.monotonic() + self._backoff_s
            backoff_s = self._backoff_s
        log = logger.warning if was_up else logger.info
        log("Redis at %s unreachable (%s); next try in %.0f s", self.url, error, backoff_s)

    def _recovered(self, error: str | None) -> None:
        with self._lock:
            was_down = self._down_until is not None
            self._down_until = None
            self._backoff_s = self._first_backoff_s
            self._last_error = error
        if was_down:
            logger.warning("Redis at %s is reachable again", self.url)

    def _count(self, hits: int = 0, misses: int = 0, corrupt: int = 0, bytes_written: int = 0):
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.corrupt += corrupt
            self._stats.bytes_written += bytes_written
