"""The layer source of the persistent tiers (SSD, remote): an entry whose header is verified,
read layer by layer into one whole-entry buffer that, once full, is the entry itself."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvstore import format as kvformat
from kvstore.types import ChunkKV


class EntryReader(ABC):
    """Reads layers of one entry into a buffer laid out like the entry's data (layer i at
    i * layer_stride), so that once every layer is read the buffer is the entry: decoded by
    `chunk_kv` for host memory, or handed as stored by `stored_entry` to a faster persistent
    tier without another encode. A tier supplies the buffer and the bytes of each layer."""

    tier: str

    def __init__(self, key: str, header: kvformat.EntryHeader, header_bytes: bytes) -> None:
        self.key = key
        self.header = header
        self.header_bytes = header_bytes
        self.num_layers = header.num_layers
        self._buffer: torch.Tensor | None = None
        self._layers_read: set[int] = set()

    def read_layer(self, layer: int) -> kvformat.LayerData:
        """K and V of `layer` as views of the read buffer: a plain [H_kv, n, D] pair, or a
        QuantizedPair for an encoded entry (dequantized wherever the caller copies it to).
        KVCorruptError when the layer's checksum is wrong; the tier's errors otherwise."""
        stride = self.header.layer_stride
        if self._buffer is None:
            self._buffer = self._allocate(self.num_layers * stride)
        block = self._buffer[layer * stride : (layer + 1) * stride]
        self._fetch(layer, block)
        pair = kvformat.decode_layer(self.header, layer, block)
        self._layers_read.add(layer)
        return pair

    def chunk_kv(self) -> ChunkKV | None:
        """The whole entry in its original dtype, or None until every layer was read: views of
        the read buffer, or for an encoded entry its dequantized copy."""
        if self._buffer is None or len(self._layers_read) < self.num_layers:
            return None
        return kvformat.decode_entry(self.header, self._buffer)

    def stored_entry(self) -> kvformat.EncodedEntry | None:
        """The entry as stored (its encoding, its checksums), or None until every layer was
        read: views of the read buffer."""
        if self._buffer is None or len(self._layers_read) < self.num_layers:
            return None
        return kvformat.stored_entry(self.header, self.header_bytes, self._buffer)

    @abstractmethod
    def close(self) -> None:
        """Release what the tier holds for the read; the buffer goes with the reader."""

    @abstractmethod
    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of `nbytes` that the tier can read into."""

    @abstractmethod
    def _fetch(self, layer: int, block: torch.Tensor) -> None:
        """Fill `block` (layer_stride bytes) with layer `layer` as stored."""
