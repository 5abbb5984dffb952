"""Named exceptions at the edges of the KV store: a bad entry on disk, and a stream that cannot
deliver a layer."""

from __future__ import annotations


class KVEntryError(Exception):
    """A stored entry cannot be used; the tiers turn it into a miss (logged, counted, deleted)."""


class KVCorruptError(KVEntryError):
    """Bad magic, header or layer checksum mismatch, truncated file, impossible shapes."""


class KVVersionError(KVEntryError):
    """The entry was written by another format version or positions convention."""


class KVModelMismatchError(KVEntryError):
    """The entry belongs to another model fingerprint (or another key than its file name says)."""


class KVStreamError(Exception):
    """A layer stream could not deliver `layer`; the engine should recompute the chunks instead.

    Raised by `layer(i)` for the failing layer and every later one; earlier layers were valid.
    """

    def __init__(self, message: str, layer: int, key: str | None = None) -> None:
        super().__init__(message)
        self.layer = layer
        self.key = key
