"""On-disk format of one chunk's KV: a versioned, checksummed header, then each layer's K and V
contiguous and 4096-byte aligned so that one layer is one direct-I/O read (docs/kvstore.md)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch
import xxhash

from kvstore.errors import KVCorruptError, KVModelMismatchError, KVVersionError
from kvstore.types import ChunkKV

MAGIC = b"RBLENDKV"
FORMAT_VERSION = 1
ALIGN = 4096  # direct I/O needs offsets, lengths and buffers aligned to the logical block size
POSITIONS = "pre_rope"
MAX_HEADER_BYTES = 1 << 20  # refuse to allocate for a garbage data offset before its checksum

# magic, version, data_offset, num_layers, num_kv_heads, num_tokens, head_dim, dtype, positions,
# fingerprint length, key length; then fingerprint, key, one u64 per layer, the header checksum.
_FIXED = struct.Struct("<8sIIIIII16s16sHH")
_U64 = struct.Struct("<Q")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def align_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


@dataclass(frozen=True)
class EntryHeader:
    """What the header of one entry file says; offsets are in bytes from the start of the file."""

    key: str
    model_fingerprint: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    num_tokens: int
    head_dim: int
    positions: str
    layer_checksums: tuple[int, ...]
    data_offset: int

    @property
    def kv_nbytes(self) -> int:
        """Bytes of one layer's K (or V) of this chunk."""
        return self.num_kv_heads * self.num_tokens * self.head_dim * self.dtype.itemsize

    @property
    def layer_stride(self) -> int:
        """Bytes from one layer's K to the next layer's K: K, V, then zero padding to ALIGN."""
        return align_up(2 * self.kv_nbytes)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.num_layers * self.layer_stride

    def layer_offset(self, layer: int) -> int:
        return self.data_offset + layer * self.layer_stride


def supported_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(_DTYPES.values())


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor; bf16 goes through a uint8 view because numpy has no bf16."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def _layer_checksum(k_bytes: memoryview, v_bytes: memoryview) -> int:
    digest = xxhash.xxh3_64()
    digest.update(k_bytes)
    digest.update(v_bytes)
    return digest.intdigest()


def _padded_ascii(text: str, size: int) -> bytes:
    raw = text.encode("ascii")
    assert len(raw) <= size, text
    return raw.ljust(size, b"\0")


def build_header(key: str, model_fingerprint: str, kv: ChunkKV) -> tuple[EntryHeader, bytes]:
    """The header of `kv` and its bytes, zero-padded to `data_offset`; kv must be on the CPU."""
    if kv.keys.dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {kv.keys.dtype} is not storable; use one of {list(_DTYPES)}")
    num_layers, num_kv_heads, num_tokens, head_dim = kv.keys.shape
    checksums = tuple(
        _layer_checksum(_as_bytes(kv.keys[i]), _as_bytes(kv.values[i])) for i in range(num_layers)
    )
    fingerprint_raw, key_raw = model_fingerprint.encode(), key.encode("ascii")
    body = bytearray(
        _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            0,
            num_layers,
            num_kv_heads,
            num_tokens,
            head_dim,
            _padded_ascii(_DTYPE_NAMES[kv.keys.dtype], 16),
            _padded_ascii(POSITIONS, 16),
            len(fingerprint_raw),
            len(key_raw),
        )
    )
    body += fingerprint_raw + key_raw + b"".join(_U64.pack(c) for c in checksums)
    data_offset = align_up(len(body) + _U64.size)
    body[12:16] = struct.pack("<I", data_offset)  # known only now, and covered by the checksum
    body += _U64.pack(xxhash.xxh3_64_intdigest(bytes(body)))
    header = EntryHeader(
        key=key,
        model_fingerprint=model_fingerprint,
        dtype=kv.keys.dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        num_tokens=num_tokens,
        head_dim=head_dim,
        positions=POSITIONS,
        layer_checksums=checksums,
        data_offset=data_offset,
    )
    return header, bytes(body.ljust(data_offset, b"\0"))


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_entry(fd: int, header: EntryHeader, header_bytes: bytes, kv: ChunkKV) -> None:
    """Write the whole entry (the header from `build_header`, then every layer of `kv`) at the
    current position of `fd`."""
    _write_all(fd, header_bytes)
    padding = bytes(header.layer_stride - 2 * header.kv_nbytes)
    for i in range(header.num_layers):
        _write_all(fd, _as_bytes(kv.keys[i]))
        _write_all(fd, _as_bytes(kv.values[i]))
        _write_all(fd, padding)


def header_size(prefix: bytes | memoryview) -> int:
    """The header's full size (= data_offset) from its first bytes; checks magic and version."""
    if len(prefix) < _FIXED.size:
        raise KVCorruptError(f"header truncated to {len(prefix)} bytes")
    magic, version, data_offset = struct.unpack_from("<8sII", prefix)
    if magic != MAGIC:
        raise KVCorruptError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise KVVersionError(f"format version {version}, this build reads {FORMAT_VERSION}")
    if data_offset < _FIXED.size or data_offset % ALIGN or data_offset > MAX_HEADER_BYTES:
        raise KVCorruptError(f"impossible data offset {data_offset}")
    return data_offset


def parse_header(block: bytes | memoryview, model_fingerprint: str, key: str) -> EntryHeader:
    """Decode and verify a header block of at least `header_size` bytes.

    Raises KVCorruptError (checksum, truncation, garbage), KVVersionError (format version or
    positions convention) or KVModelMismatchError (another model's entry, or another key's).
    """
    data_offset = header_size(block)
    if len(block) < data_offset:
        raise KVCorruptError(f"header truncated to {len(block)} of {data_offset} bytes")
    (
        _,
        _,
        _,
        num_layers,
        num_kv_heads,
        num_tokens,
        head_dim,
        dtype_raw,
        positions_raw,
        fingerprint_len,
        key_len,
    ) = _FIXED.unpack_from(block)
    checksums_at = _FIXED.size + fingerprint_len + key_len
    checksum_at = checksums_at + _U64.size * num_layers
    if checksum_at + _U64.size > data_offset:
        raise KVCorruptError("header fields overrun the header")
    (stored_checksum,) = _U64.unpack_from(block, checksum_at)
    if xxhash.xxh3_64_intdigest(bytes(block[:checksum_at])) != stored_checksum:
        raise KVCorruptError("header checksum mismatch")
    fingerprint = bytes(block[_FIXED.size : _FIXED.size + fingerprint_len]).decode()
    stored_key = bytes(block[_FIXED.size + fingerprint_len : checksums_at]).decode("ascii")
    dtype_name = dtype_raw.rstrip(b"\0").decode("ascii")
    positions = positions_raw.rstrip(b"\0").decode("ascii")
    if positions != POSITIONS:
        raise KVVersionError(f"positions convention {positions!r}, this build uses {POSITIONS!r}")
    if dtype_name not in _DTYPES or min(num_layers, num_kv_heads, num_tokens, head_dim) < 1:
        raise KVCorruptError(f"impossible dtype or shape {dtype_name} {num_layers=} {num_tokens=}")
    if fingerprint != model_fingerprint:
        raise KVModelMismatchError(
            f"entry of model {fingerprint!r}, this store is {model_fingerprint!r}"
        )
    if stored_key != key:
        raise KVModelMismatchError(f"entry says key {stored_key}, its file name says {key}")
    checksums = tuple(
        _U64.unpack_from(block, checksums_at + _U64.size * i)[0] for i in range(num_layers)
    )
    return EntryHeader(
        key=key,
        model_fingerprint=fingerprint,
        dtype=_DTYPES[dtype_name],
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        num_tokens=num_tokens,
        head_dim=head_dim,
        positions=positions,
        layer_checksums=checksums,
        data_offset=data_offset,
    )


def decode_layer(
    header: EntryHeader, layer: int, block: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `layer` as views of `block` (uint8, the layer's bytes from its offset on).

    Raises KVCorruptError when the layer checksum does not match.
    """
    kv_nbytes = header.kv_nbytes
    k_raw, v_raw = block[:kv_nbytes], block[kv_nbytes : 2 * kv_nbytes]
    actual = _layer_checksum(k_raw.numpy().data, v_raw.numpy().data)
    if actual != header.layer_checksums[layer]:
        raise KVCorruptError(f"layer {layer} checksum mismatch in entry {header.key}")
    shape = (header.num_kv_heads, header.num_tokens, header.head_dim)
    return k_raw.view(header.dtype).view(shape), v_raw.view(header.dtype).view(shape)
