"""Rendezvous (highest-random-weight) hashing of a chunk set onto the engine pool, so the same
chunks land on the same engine and its KV tiers stay warm."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence


def chunk_set_key(chunk_ids: Iterable[str]) -> str:
    """Order-free key of a chunk set: retrieval order varies, the KV a set needs does not."""
    return "\n".join(sorted(set(chunk_ids)))


def _weight(engine_url: str, key: str) -> int:
    digest = hashlib.blake2b(f"{engine_url}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank_engines(engine_urls: Sequence[str], chunk_ids: Iterable[str]) -> list[str]:
    """All engines, preferred first; the order for one chunk set only changes for the engine
    that is added or removed (the rest keep their relative order)."""
    key = chunk_set_key(chunk_ids)
    return sorted(engine_urls, key=lambda url: _weight(url, key), reverse=True)
