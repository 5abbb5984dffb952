"""Bounds on the retriever's native heap (glibc): fewer malloc arenas, and the free pages of
a large ingest handed back to the system; both do nothing on another C library."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter number
# Two arenas: searches and ingests from many worker threads then share a few heaps instead
# of each thread growing (and fragmenting) its own 64 MB arena (docs/retriever.md).
DEFAULT_ARENA_MAX = 2


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def limit_malloc_arenas(arena_max: int = DEFAULT_ARENA_MAX) -> None:
    """Cap glibc's malloc arenas unless MALLOC_ARENA_MAX already did (the operator's choice
    wins); call it before worker threads start."""
    libc = _libc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return
    if libc.mallopt(M_ARENA_MAX, arena_max) != 1:
        logger.warning("could not limit malloc arenas to %d", arena_max)


def trim_heap() -> None:
    """Return free heap pages to the system (after work that allocated hundreds of MB)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
