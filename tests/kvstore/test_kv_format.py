"""The on-disk format: exact round trip per dtype, compressed encodings, aligned layers, version-1
files still read, and each named header error."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from kvstore import codec
from kvstore import format as kvformat
from kvstore.codec import QuantizedPair
from kvstore.errors import KVCorruptError, KVEntryError, KVModelMismatchError, KVVersionError
from kvstore.ssd_tier import SSDTier, aligned_empty
from tests.kvstore.kv_testutil import FINGERPRINT, key_of, make_kv

KEY = key_of(1)


def _write(path: Path, kv, key: str = KEY, fingerprint: str = FINGERPRINT, encoding: str = "none"):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        entry = kvformat.encode_entry(key, fingerprint, kv, encoding)
        kvformat.write_entry(fd, entry)
        return entry.header
    finally:
        os.close(fd)


def _read_layers(path: Path, header: kvformat.EntryHeader):
    data = path.read_bytes()
    layers = []
    for i in range(header.num_layers):
        block = aligned_empty(header.layer_stride)
        start = header.layer_offset(i)
        block.copy_(
            torch.frombuffer(
                bytearray(data[start : start + header.layer_stride]), dtype=torch.uint8
            )
        )
        layers.append(kvformat.decode_layer(header, i, block))
    return layers


def test_round_trip_is_bit_exact_for_each_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    kv = make_kv(seed=3, dtype=dtype)
    written = _write(tmp_path / "e.kv", kv)
    header = kvformat.parse_header((tmp_path / "e.kv").read_bytes(), FINGERPRINT, KEY)
    assert header == written
    assert header.dtype == dtype and header.positions == "pre_rope"
    for i, (k, v) in enumerate(_read_layers(tmp_path / "e.kv", header)):
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])


def test_layers_start_aligned_and_file_size_matches_header(tmp_path: Path) -> None:
    header = _write(tmp_path / "e.kv", make_kv(num_tokens=7, dtype=torch.bfloat16))
    assert header.data_offset % kvformat.ALIGN == 0
    assert header.layer_stride % kvformat.ALIGN == 0
    assert all(header.layer_offset(i) % kvformat.ALIGN == 0 for i in range(header.num_layers))
    assert (tmp_path / "e.kv").stat().st_size == header.file_size


def test_flipped_layer_byte_fails_that_layers_checksum(tmp_path: Path) -> None:
    path = tmp_path / "e.kv"
    header = _write(path, make_kv())
    data = bytearray(path.read_bytes())
    data[header.layer_offset(2) + 3] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(KVCorruptError, match="layer 2"):
        _read_layers(path, header)


def test_flipped_header_byte_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "e.kv"
    _write(path, make_kv())
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # num_kv_heads
    with pytest.raises(KVCorruptError, match="header checksum"):
        kvformat.parse_header(bytes(data), FINGERPRINT, KEY)


def test_other_format_version_raises_version_error(tmp_path: Path) -> None:
    path = tmp_path / "e.kv"
    _write(path, make_kv())
    data = bytearray(path.read_bytes())
    for version in (0, kvformat.FORMAT_VERSION + 1):
        data[8:12] = struct.pack("<I", version)
        with pytest.raises(KVVersionError, match=f"format version {version}"):
            kvformat.parse_header(bytes(data), FINGERPRINT, KEY)


def test_entry_of_another_model_raises_model_mismatch(tmp_path: Path) -> None:
    _write(tmp_path / "e.kv", make_kv(), fingerprint="other-model")
    with pytest.raises(KVModelMismatchError):
        kvformat.parse_header((tmp_path / "e.kv").read_bytes(), FINGERPRINT, KEY)


def test_entry_under_another_key_raises_model_mismatch(tmp_path: Path) -> None:
    _write(tmp_path / "e.kv", make_kv())
    with pytest.raises(KVModelMismatchError):
        kvformat.parse_header((tmp_path / "e.kv").read_bytes(), FINGERPRINT, key_of(2))


@pytest.mark.parametrize("length", [0, 10, 100])
def test_truncated_or_foreign_header_is_corrupt(tmp_path: Path, length: int) -> None:
    _write(tmp_path / "e.kv", make_kv())
    data = (tmp_path / "e.kv").read_bytes()[:length]
    with pytest.raises(KVCorruptError):
        kvformat.parse_header(data, FINGERPRINT, KEY)
    with pytest.raises(KVCorruptError, match="magic"):
        kvformat.parse_header(b"x" * 4096, FINGERPRINT, KEY)


def test_all_header_errors_share_one_base_class() -> None:
    assert all(
        issubclass(e, KVEntryError) for e in (KVCorruptError, KVVersionError, KVModelMismatchError)
    )


def test_unsupported_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not storable"):
        kvformat.build_header(KEY, FINGERPRINT, make_kv(dtype=torch.float64))


# -- compressed encodings ------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["fp8_e4m3", "int8"])
def test_encoded_layers_decode_to_quantized_pairs_of_the_written_values(
    tmp_path: Path, dtype: torch.dtype, encoding: str
) -> None:
    kv = make_kv(seed=4, dtype=dtype, num_tokens=9)
    written = _write(tmp_path / "e.kv", kv, encoding=encoding)
    header = kvformat.parse_header((tmp_path / "e.kv").read_bytes(), FINGERPRINT, KEY)
    assert header == written
    assert (header.encoding, header.version, header.dtype) == (encoding, 2, dtype)
    expected = codec.round_trip(kv, encoding)
    for i, pair in enumerate(_read_layers(tmp_path / "e.kv", header)):
        assert isinstance(pair, QuantizedPair) and pair.dtype == dtype
        assert pair.k.element_size() == 1 and pair.k_scale.shape == (2, 1, 8)
        k, v = pair.dequantize()
        assert torch.equal(k, expected.keys[i]) and torch.equal(v, expected.values[i])


@pytest.mark.parametrize("encoding", ["fp8_e4m3", "int8"])
def test_decode_entry_dequantizes_every_layer(tmp_path: Path, encoding: str) -> None:
    kv = make_kv(seed=6, dtype=torch.float16)
    header = _write(tmp_path / "e.kv", kv, encoding=encoding)
    data = (tmp_path / "e.kv").read_bytes()[header.data_offset :]
    entry = kvformat.decode_entry(header, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    expected = codec.round_trip(kv, encoding)
    assert torch.equal(entry.keys, expected.keys) and torch.equal(entry.values, expected.values)


def test_scales_stay_aligned_when_the_payload_has_an_odd_size(tmp_path: Path) -> None:
    kv = make_kv(num_layers=3, num_kv_heads=1, num_tokens=3, head_dim=5)  # 15-byte payloads
    header = _write(tmp_path / "e.kv", kv, encoding="int8")
    assert header.kv_nbytes == 15 and header.scales_offset == 32
    assert header.layer_stride % kvformat.ALIGN == 0
    assert all(header.layer_offset(i) % kvformat.ALIGN == 0 for i in range(header.num_layers))
    assert (tmp_path / "e.kv").stat().st_size == header.file_size
    expected = codec.round_trip(kv, "int8")
    for i, pair in enumerate(_read_layers(tmp_path / "e.kv", header)):
        assert torch.equal(pair.dequantize()[1], expected.values[i])


def _part_offsets(header: kvformat.EntryHeader) -> dict[str, int]:
    return {
        "k_payload": 1,
        "v_payload": header.kv_nbytes + 2,
        "k_scales": header.scales_offset + 1,
        "v_scales": header.scales_offset + header.scale_nbytes + 3,
    }


@pytest.mark.parametrize("encoding", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("part", ["k_payload", "v_payload", "k_scales", "v_scales"])
def test_a_flipped_payload_or_scale_byte_fails_that_layers_checksum(
    tmp_path: Path, encoding: str, part: str
) -> None:
    path = tmp_path / "e.kv"
    header = _write(path, make_kv(), encoding=encoding)
    data = bytearray(path.read_bytes())
    data[header.layer_offset(1) + _part_offsets(header)[part]] ^= 0x04
    path.write_bytes(data)
    with pytest.raises(KVCorruptError, match="layer 1 checksum"):
        _read_layers(path, header)


@pytest.mark.parametrize(
    ("dtype", "ratio"), [(torch.float32, 0.25), (torch.bfloat16, 0.5), (torch.float16, 0.5)]
)
@pytest.mark.parametrize("encoding", ["fp8_e4m3", "int8"])
def test_one_byte_encodings_quarter_fp32_and_halve_16_bit_files(
    tmp_path: Path, dtype: torch.dtype, ratio: float, encoding: str
) -> None:
    kv = make_kv(dtype=dtype, num_layers=2, num_kv_heads=4, num_tokens=256, head_dim=64)
    plain = _write(tmp_path / "plain.kv", kv)
    compressed = _write(tmp_path / "small.kv", kv, encoding=encoding)
    assert compressed.file_size / plain.file_size == pytest.approx(ratio, abs=0.02)


def test_unknown_encoding_is_a_version_error_even_with_a_valid_checksum(tmp_path: Path) -> None:
    path = tmp_path / "e.kv"
    header = _write(path, make_kv(), encoding="int8")
    data = bytearray(path.read_bytes())
    data[64:80] = b"int4".ljust(16, b"\0")
    checksum_at = 84 + len(FINGERPRINT) + len(KEY) + 8 * header.num_layers
    data[checksum_at : checksum_at + 8] = struct.pack(
        "<Q", xxhash.xxh3_64_intdigest(bytes(data[:checksum_at]))
    )
    with pytest.raises(KVVersionError, match="int4"):
        kvformat.parse_header(bytes(data), FINGERPRINT, KEY)


def test_encoding_field_is_covered_by_the_header_checksum(tmp_path: Path) -> None:
    path = tmp_path / "e.kv"
    _write(path, make_kv(), encoding="int8")
    data = bytearray(path.read_bytes())
    data[64:80] = b"fp8_e4m3".ljust(16, b"\0")
    with pytest.raises(KVCorruptError, match="header checksum"):
        kvformat.parse_header(bytes(data), FINGERPRINT, KEY)


def test_unknown_encoding_cannot_be_written() -> None:
    with pytest.raises(ValueError, match="none, fp8_e4m3, int8"):
        kvformat.encode(make_kv(), "int4")


# -- version 1 -----------------------------------------------------------------------------------


def write_v1(path: Path, kv, key: str = KEY, fingerprint: str = FINGERPRINT) -> None:
    """A version-1 entry as the format wrote it before encodings: no encoding field, K and V of
    each layer, their checksum over K then V."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    num_layers, heads, tokens, dim = kv.keys.shape

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    checksums = [
        xxhash.xxh3_64_intdigest(raw(kv.keys[i]) + raw(kv.values[i])) for i in range(num_layers)
    ]
    body = bytearray(
        struct.pack(
            "<8sIIIIII16s16sHH",
            b"RBLENDKV",
            1,
            0,
            num_layers,
            heads,
            tokens,
            dim,
            names[kv.keys.dtype].encode().ljust(16, b"\0"),
            b"pre_rope".ljust(16, b"\0"),
            len(fingerprint),
            len(key),
        )
    )
    body += fingerprint.encode() + key.encode() + b"".join(struct.pack("<Q", c) for c in checksums)
    data_offset = -(-(len(body) + 8) // 4096) * 4096
    body[12:16] = struct.pack("<I", data_offset)
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body)))
    out = bytes(body.ljust(data_offset, b"\0"))
    layer_bytes = 2 * heads * tokens * dim * kv.keys.element_size()
    for i in range(num_layers):
        out += raw(kv.keys[i]) + raw(kv.values[i]) + bytes(-layer_bytes % 4096)
    path.write_bytes(out)


def test_version_1_files_still_read_bit_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    kv = make_kv(seed=9, dtype=dtype, num_tokens=7)
    path = tmp_path / "v1.kv"
    write_v1(path, kv)
    header = kvformat.parse_header(path.read_bytes(), FINGERPRINT, KEY)
    assert (header.version, header.encoding, header.dtype) == (1, "none", dtype)
    assert path.stat().st_size == header.file_size
    for i, (k, v) in enumerate(_read_layers(path, header)):
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])


def test_an_ssd_tier_adopts_and_reads_version_1_files(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding="int8")
    kv = make_kv(seed=10, dtype=torch.bfloat16)
    tier.file_path(KEY).parent.mkdir(parents=True)
    write_v1(tier.file_path(KEY), kv)
    assert tier.check().adopted_files == 1
    back = tier.get(KEY)
    assert back is not None
    assert torch.equal(back.keys, kv.keys) and torch.equal(back.values, kv.values)
