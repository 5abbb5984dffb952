"""Helpers for the kvstore tests: deterministic random chunk KV, keys, and byte surgery on entry
files. (Imported as tests.kvstore.kv_testutil, the name pytest gives this folder.)"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvstore import format as kvformat
from kvstore.store import KVStore
from kvstore.types import ChunkKV, chunk_key

FINGERPRINT = "test-model/v1"


def make_kv(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 4,
    num_kv_heads: int = 2,
    num_tokens: int = 5,
    head_dim: int = 8,
) -> ChunkKV:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_kv_heads, num_tokens, head_dim)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    return ChunkKV(keys=keys, values=values)


def key_of(index: int) -> str:
    return chunk_key(FINGERPRINT, [index, index + 1, index + 2])


def assert_kv_equal(actual: ChunkKV, expected: ChunkKV) -> None:
    assert actual.keys.dtype == expected.keys.dtype
    assert torch.equal(actual.keys, expected.keys)
    assert torch.equal(actual.values, expected.values)


def read_entry(store: KVStore, key: str) -> ChunkKV | None:
    """The whole entry read through the store's read path (a one-key layer stream), or None on
    a miss; an SSD hit is promoted to memory in the background (`store.flush()` waits)."""
    with store.open_stream([key]) as stream:
        if not stream.present[0]:
            return None
        layers = [stream.layer(i)[0] for i in range(stream.num_layers)]
    return ChunkKV(
        keys=torch.stack([k for k, _ in layers]), values=torch.stack([v for _, v in layers])
    )


def read_header(path: Path, key: str, fingerprint: str = FINGERPRINT) -> kvformat.EntryHeader:
    data = path.read_bytes()
    return kvformat.parse_header(data, fingerprint, key)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
