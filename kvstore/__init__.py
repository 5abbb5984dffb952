"""KV cache storage: on-disk format, memory and SSD tiers, layer-by-layer streaming."""

from kvstore.errors import (
    KVCorruptError,
    KVEntryError,
    KVModelMismatchError,
    KVStreamError,
    KVVersionError,
)
from kvstore.loader import KVLayerStream
from kvstore.ssd_tier import CheckReport
from kvstore.store import KVStore, KVStoreConfig, StoreStats
from kvstore.types import ChunkKV, LayerStream, LayerTiming, StreamStats, TierStats, chunk_key

__all__ = [
    "CheckReport",
    "ChunkKV",
    "KVCorruptError",
    "KVEntryError",
    "KVLayerStream",
    "KVModelMismatchError",
    "KVStore",
    "KVStoreConfig",
    "KVStreamError",
    "KVVersionError",
    "LayerStream",
    "LayerTiming",
    "StoreStats",
    "StreamStats",
    "TierStats",
    "chunk_key",
]
