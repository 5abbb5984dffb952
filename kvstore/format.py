"""On-disk format of one chunk's KV: a versioned, checksummed header, then each layer's K and V
contiguous and 4096-byte aligned so that one layer is one direct-I/O read (docs/kvstore.md)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch
import xxhash

from kvstore import codec
from kvstore.codec import Encoding, QuantizedPair
from kvstore.errors import KVCorruptError, KVModelMismatchError, KVVersionError
from kvstore.types import ChunkKV, kv_token_bytes

MAGIC = b"RBLENDKV"
FORMAT_VERSION = 2  # 2 added the encoding field and per-layer scales; 1 is read as "none"
READABLE_VERSIONS = (1, FORMAT_VERSION)
ALIGN = 4096  # direct I/O needs offsets, lengths and buffers aligned to the logical block size
SCALE_ALIGN = 16  # the float32 scales are viewed in place in the read buffer
POSITIONS = "pre_rope"
MAX_HEADER_BYTES = 1 << 20  # refuse to allocate for a garbage data offset before its checksum

# magic, version, data_offset, num_layers, num_kv_heads, num_tokens, head_dim, dtype, positions,
# encoding (version 2 on), fingerprint length, key length; then fingerprint, key, one u64 per
# layer, the header checksum.
_FIXED_BY_VERSION = {
    1: struct.Struct("<8sIIIIII16s16sHH"),
    2: struct.Struct("<8sIIIIII16s16s16sHH"),
}
_FIXED = _FIXED_BY_VERSION[FORMAT_VERSION]
_PREFIX = struct.Struct("<8sII")  # magic, version, data_offset: the same in every version
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
    """What the header of one entry file says; offsets are in bytes from the start of the file.
    `dtype` is the dtype of the values before encoding (what a reader gets back)."""

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
    encoding: Encoding
    version: int

    @property
    def storage_dtype(self) -> torch.dtype:
        return codec.storage_dtype(self.encoding, self.dtype)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of one layer's K (or V) payload of this chunk, as stored."""
        return self.num_kv_heads * self.num_tokens * self.head_dim * self.storage_dtype.itemsize

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of the whole entry decoded (`ChunkKV.nbytes`): what it takes in memory."""
        return (
            kv_token_bytes(self.num_kv_heads, self.head_dim, self.dtype, self.num_layers)
            * self.num_tokens
        )

    @property
    def scale_nbytes(self) -> int:
        """Bytes of one layer's K (or V) scales: one float32 per head and channel, or none."""
        if self.encoding == "none":
            return 0
        return self.num_kv_heads * self.head_dim * codec.SCALE_DTYPE.itemsize

    @property
    def scales_offset(self) -> int:
        """Where a layer's K scales start, from the layer's offset (V scales follow)."""
        if self.encoding == "none":
            return 2 * self.kv_nbytes
        return align_up(2 * self.kv_nbytes, SCALE_ALIGN)

    @property
    def layer_stride(self) -> int:
        """Bytes from one layer's K to the next layer's K: K, V, K scales, V scales, then zero
        padding to ALIGN."""
        return align_up(self.scales_offset + 2 * self.scale_nbytes)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.num_layers * self.layer_stride

    def layer_offset(self, layer: int) -> int:
        return self.data_offset + layer * self.layer_stride


@dataclass(frozen=True)
class EncodedKV:
    """A chunk's KV as an entry stores it: payloads [L, H_kv, n, D] in the encoding's storage
    dtype and, unless the encoding is "none", scales [L, H_kv, 1, D] float32."""

    dtype: torch.dtype
    encoding: Encoding
    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None

    def layer_parts(self, layer: int) -> list[memoryview]:
        """The bytes of one layer in file order: K, V, then K and V scales if any."""
        parts = [_as_bytes(self.keys[layer]), _as_bytes(self.values[layer])]
        if self.key_scales is not None and self.value_scales is not None:
            parts += [_as_bytes(self.key_scales[layer]), _as_bytes(self.value_scales[layer])]
        return parts


def encode(kv: ChunkKV, encoding: str = "none") -> EncodedKV:
    """`kv` (host tensors) ready to write in `encoding`; ValueError for a dtype the format cannot
    store or an unknown encoding."""
    if kv.keys.dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {kv.keys.dtype} is not storable; use one of {list(_DTYPES)}")
    name = codec.check_encoding(encoding)
    if name == "none":
        return EncodedKV(kv.keys.dtype, name, kv.keys, kv.values)
    keys, key_scales = codec.quantize(kv.keys, name)
    values, value_scales = codec.quantize(kv.values, name)
    return EncodedKV(kv.keys.dtype, name, keys, values, key_scales, value_scales)


def supported_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(_DTYPES.values())


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor; bf16 and fp8 go through a uint8 view (numpy has neither)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def _layer_checksum(parts: list[memoryview]) -> int:
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def _padded_ascii(text: str, size: int) -> bytes:
    raw = text.encode("ascii")
    assert len(raw) <= size, text
    return raw.ljust(size, b"\0")


def build_header(
    key: str, model_fingerprint: str, kv: ChunkKV | EncodedKV
) -> tuple[EntryHeader, bytes]:
    """The header of `kv` (a ChunkKV is written as encoding "none") and its bytes, zero-padded to
    `data_offset`; kv must be on the CPU."""
    encoded = kv if isinstance(kv, EncodedKV) else encode(kv)
    num_layers, num_kv_heads, num_tokens, head_dim = encoded.keys.shape
    checksums = tuple(_layer_checksum(encoded.layer_parts(i)) for i in range(num_layers))
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
            _padded_ascii(_DTYPE_NAMES[encoded.dtype], 16),
            _padded_ascii(POSITIONS, 16),
            _padded_ascii(encoded.encoding, 16),
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
        dtype=encoded.dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        num_tokens=num_tokens,
        head_dim=head_dim,
        positions=POSITIONS,
        layer_checksums=checksums,
        data_offset=data_offset,
        encoding=encoded.encoding,
        version=FORMAT_VERSION,
    )
    return header, bytes(body.ljust(data_offset, b"\0"))


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def layer_nbytes(header: EntryHeader) -> int:
    """Bytes of one layer as stored (K, V, the gap before the scales, K and V scales), without
    its trailing padding to ALIGN: a remote entry's layer value."""
    return header.scales_offset + 2 * header.scale_nbytes


@dataclass(frozen=True)
class EncodedEntry:
    """An entry ready for any persistent tier: its header, the header's bytes (zero-padded to
    `data_offset`) and each layer's stored bytes in parts (`layer_nbytes` in all, no padding).
    One is built per write and shared by the tiers, so an entry is encoded once."""

    header: EntryHeader
    header_bytes: bytes
    layers: tuple[tuple[memoryview | bytes, ...], ...]

    @property
    def key(self) -> str:
        return self.header.key


def encode_entry(key: str, model_fingerprint: str, kv: ChunkKV, encoding: str) -> EncodedEntry:
    """`kv` (host tensors) as an entry in `encoding`; ValueError for a dtype the format cannot
    store, an unknown encoding, or KV the encoding cannot hold (inf or NaN)."""
    encoded = encode(kv, encoding)
    header, header_bytes = build_header(key, model_fingerprint, encoded)
    gap = bytes(header.scales_offset - 2 * header.kv_nbytes)
    layers: list[tuple[memoryview | bytes, ...]] = []
    for i in range(header.num_layers):
        k, v, *scales = encoded.layer_parts(i)
        layers.append((k, v, gap, *scales))
    return EncodedEntry(header, header_bytes, tuple(layers))


def stored_entry(header: EntryHeader, header_bytes: bytes, buffer: torch.Tensor) -> EncodedEntry:
    """An entry read whole into `buffer` (uint8, layer i at i * layer_stride) as it was stored,
    to write to another tier without decoding and encoding it again."""
    nbytes, stride = layer_nbytes(header), header.layer_stride
    layers = tuple(
        (_as_bytes(buffer[i * stride : i * stride + nbytes]),) for i in range(header.num_layers)
    )
    return EncodedEntry(header, header_bytes, layers)


def write_entry(fd: int, entry: EncodedEntry) -> None:
    """Write the whole entry (header, then every layer padded to `layer_stride`) at the current
    position of `fd`."""
    header = entry.header
    _write_all(fd, entry.header_bytes)
    padding = bytes(header.layer_stride - layer_nbytes(header))
    for parts in entry.layers:
        for part in parts:
            _write_all(fd, part)
        _write_all(fd, padding)


def _version(prefix: bytes | memoryview) -> int:
    if len(prefix) < _PREFIX.size:
        raise KVCorruptError(f"header truncated to {len(prefix)} bytes")
    magic, version, _ = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise KVCorruptError(f"bad magic {magic!r}")
    if version not in READABLE_VERSIONS:
        raise KVVersionError(f"format version {version}, this build reads {READABLE_VERSIONS}")
    return int(version)


def header_size(prefix: bytes | memoryview) -> int:
    """The header's full size (= data_offset) from its first bytes; checks magic and version."""
    fixed = _FIXED_BY_VERSION[_version(prefix)]
    if len(prefix) < fixed.size:
        raise KVCorruptError(f"header truncated to {len(prefix)} bytes")
    (data_offset,) = struct.unpack_from("<I", prefix, 12)
    if data_offset < fixed.size or data_offset % ALIGN or data_offset > MAX_HEADER_BYTES:
        raise KVCorruptError(f"impossible data offset {data_offset}")
    return int(data_offset)


def parse_header(block: bytes | memoryview, model_fingerprint: str, key: str) -> EntryHeader:
    """Decode and verify a header block of at least `header_size` bytes.

    Raises KVCorruptError (checksum, truncation, garbage), KVVersionError (format version,
    positions convention or encoding this build does not know) or KVModelMismatchError (another
    model's entry, or another key's).
    """
    data_offset = header_size(block)
    if len(block) < data_offset:
        raise KVCorruptError(f"header truncated to {len(block)} of {data_offset} bytes")
    version = _version(block)
    fixed = _FIXED_BY_VERSION[version]
    fields = fixed.unpack_from(block)
    num_layers, num_kv_heads, num_tokens, head_dim, dtype_raw, positions_raw = fields[3:9]
    encoding_raw = fields[9] if version >= 2 else b"none"
    fingerprint_len, key_len = fields[-2:]
    checksums_at = fixed.size + fingerprint_len + key_len
    checksum_at = checksums_at + _U64.size * num_layers
    if checksum_at + _U64.size > data_offset:
        raise KVCorruptError("header fields overrun the header")
    (stored_checksum,) = _U64.unpack_from(block, checksum_at)
    if xxhash.xxh3_64_intdigest(bytes(block[:checksum_at])) != stored_checksum:
        raise KVCorruptError("header checksum mismatch")
    fingerprint = bytes(block[fixed.size : fixed.size + fingerprint_len]).decode()
    stored_key = bytes(block[fixed.size + fingerprint_len : checksums_at]).decode("ascii")
    dtype_name = dtype_raw.rstrip(b"\0").decode("ascii")
    positions = positions_raw.rstrip(b"\0").decode("ascii")
    if positions != POSITIONS:
        raise KVVersionError(f"positions convention {positions!r}, this build uses {POSITIONS!r}")
    try:
        encoding = codec.check_encoding(encoding_raw.rstrip(b"\0").decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise KVVersionError(f"KV encoding {encoding_raw!r}: {exc}") from exc
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
        encoding=encoding,
        version=version,
    )


LayerData = tuple[torch.Tensor, torch.Tensor] | QuantizedPair


def _split(header: EntryHeader, rows: torch.Tensor) -> list[torch.Tensor]:
    """K, V and (when encoded) K and V scales as typed views of `rows` ([..., >= stride] uint8:
    one layer, or every layer stacked), shaped [..., H_kv, n, D] and [..., H_kv, 1, D]."""
    outer = rows.shape[:-1]
    kv_nbytes, at = header.kv_nbytes, header.scales_offset
    payload = (*outer, header.num_kv_heads, header.num_tokens, header.head_dim)
    dtype = header.storage_dtype
    parts = [
        rows[..., :kv_nbytes].view(dtype).view(payload),
        rows[..., kv_nbytes : 2 * kv_nbytes].view(dtype).view(payload),
    ]
    if header.encoding != "none":
        scale_shape = (*outer, header.num_kv_heads, 1, header.head_dim)
        for start in (at, at + header.scale_nbytes):
            scales = rows[..., start : start + header.scale_nbytes].view(codec.SCALE_DTYPE)
            parts.append(scales.view(scale_shape))
    return parts


def decode_layer(header: EntryHeader, layer: int, block: torch.Tensor) -> LayerData:
    """K and V of `layer` as views of `block` (uint8, the layer's bytes from its offset on): a
    plain pair for encoding "none", else a QuantizedPair (payloads and scales).

    Raises KVCorruptError when the layer checksum (payloads and scales) does not match.
    """
    parts = _split(header, block[: header.layer_stride])
    if _layer_checksum([_as_bytes(p) for p in parts]) != header.layer_checksums[layer]:
        raise KVCorruptError(f"layer {layer} checksum mismatch in entry {header.key}")
    if header.encoding == "none":
        return parts[0], parts[1]
    k, v, k_scale, v_scale = parts
    return QuantizedPair(k, v, k_scale, v_scale, header.dtype)


def decode_entry(header: EntryHeader, buffer: torch.Tensor) -> ChunkKV:
    """The whole entry from `buffer` (uint8, every layer from the first one's offset on, their
    checksums already verified): views for encoding "none", else dequantized to `dtype`."""
    rows = buffer[: header.num_layers * header.layer_stride].view(
        header.num_layers, header.layer_stride
    )
    parts = _split(header, rows)
    if header.encoding == "none":
        return ChunkKV(keys=parts[0], values=parts[1])
    keys, values, key_scales, value_scales = parts
    return ChunkKV(
        keys=codec.dequantize(keys, key_scales, header.dtype),
        values=codec.dequantize(values, value_scales, header.dtype),
    )
