"""The on-disk format: exact round trip per dtype, aligned layers, and each named header error."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from kvstore import format as kvformat
from kvstore.errors import KVCorruptError, KVEntryError, KVModelMismatchError, KVVersionError
from kvstore.ssd_tier import aligned_empty
from tests.kvstore.kv_testutil import FINGERPRINT, key_of, make_kv

KEY = key_of(1)


def _write(path: Path, kv, key: str = KEY, fingerprint: str = FINGERPRINT):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        header, header_bytes = kvformat.build_header(key, fingerprint, kv)
        kvformat.write_entry(fd, header, header_bytes, kv)
        return header
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
    data[8:12] = struct.pack("<I", kvformat.FORMAT_VERSION + 1)
    with pytest.raises(KVVersionError):
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
