"""The SSD tier: round trip, exact LRU eviction, restart rebuild, every kind of bad entry as a
counted miss with its file deleted, failed writes leaving nothing, check(), and entries in each
encoding (compressed on disk, read back in their original dtype)."""

from __future__ import annotations

import errno
import os
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstore import codec
from kvstore import format as kvformat
from kvstore.codec import QuantizedPair
from kvstore.ssd_tier import SSDTier
from tests.kvstore.kv_testutil import FINGERPRINT, assert_kv_equal, flip_byte, key_of, make_kv

KEYS = [key_of(i) for i in range(6)]
FILE_BYTES = kvformat.build_header(KEYS[0], FINGERPRINT, make_kv())[0].file_size


def _tier(path: Path, budget_entries: int = 100) -> SSDTier:
    return SSDTier(path, budget_bytes=budget_entries * FILE_BYTES, model_fingerprint=FINGERPRINT)


def _entry_files(path: Path) -> list[Path]:
    return sorted(path.glob("*/*.kv"))


def _temp_files(path: Path) -> list[Path]:
    return sorted(path.glob("*/.*.tmp"))


def test_round_trip_is_exact_for_each_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    tier = _tier(tmp_path)
    kv = make_kv(seed=7, dtype=dtype)
    tier.put(KEYS[0], kv)
    assert_kv_equal(tier.get(KEYS[0]), kv)
    assert tier.file_path(KEYS[0]).parent.name == KEYS[0][:2]


def test_eviction_under_byte_budget_is_exact_lru_order(tmp_path: Path) -> None:
    tier = _tier(tmp_path, budget_entries=3)
    for i in range(3):
        assert tier.put(KEYS[i], make_kv(seed=i)) == []
    assert tier.get(KEYS[0]) is not None  # 0 becomes most recently used
    assert tier.put(KEYS[3], make_kv(seed=3)) == [KEYS[1]]
    assert tier.put(KEYS[4], make_kv(seed=4)) == [KEYS[2]]
    assert tier.keys_lru_first() == [KEYS[0], KEYS[3], KEYS[4]]
    assert {p.name for p in _entry_files(tmp_path)} == {f"{k}.kv" for k in tier.keys_lru_first()}
    assert tier.stats().evictions == 2


def test_restart_rebuilds_index_and_lru_order_from_file_stamps(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for i in range(4):
        tier.put(KEYS[i], make_kv(seed=i))
    tier.get(KEYS[1])
    tier.get(KEYS[0])
    reopened = _tier(tmp_path)
    assert reopened.keys_lru_first() == [KEYS[2], KEYS[3], KEYS[1], KEYS[0]]
    assert reopened.stats().bytes == 4 * FILE_BYTES
    assert_kv_equal(reopened.get(KEYS[3]), make_kv(seed=3))


def test_restart_with_smaller_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for i in range(4):
        tier.put(KEYS[i], make_kv(seed=i))
    tier.get(KEYS[0])
    reopened = _tier(tmp_path, budget_entries=2)
    assert reopened.keys_lru_first() == [KEYS[3], KEYS[0]]
    assert len(_entry_files(tmp_path)) == 2


def _flip_layer_byte(path: Path) -> None:
    header = kvformat.parse_header(path.read_bytes(), FINGERPRINT, path.name[:-3])
    flip_byte(path, header.layer_offset(header.num_layers - 1) + 5)


def _flip_header_byte(path: Path) -> None:
    flip_byte(path, 24)  # num_tokens


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _bump_version(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", kvformat.FORMAT_VERSION + 1))


def _other_model(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        kv = make_kv()
        kvformat.write_entry(fd, kvformat.encode_entry(path.name[:-3], "another-model", kv, "none"))
    finally:
        os.close(fd)


DAMAGES: dict[str, Callable[[Path], None]] = {
    "flipped_layer_byte": _flip_layer_byte,
    "flipped_header_byte": _flip_header_byte,
    "truncated": _truncate,
    "wrong_version": _bump_version,
    "other_model": _other_model,
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_bad_entry_is_a_counted_miss_and_its_file_is_deleted(tmp_path: Path, damage: str) -> None:
    tier = _tier(tmp_path)
    tier.put(KEYS[0], make_kv())
    tier.put(KEYS[1], make_kv(seed=1))
    DAMAGES[damage](tier.file_path(KEYS[0]))
    assert tier.get(KEYS[0]) is None
    assert not tier.file_path(KEYS[0]).exists()
    assert KEYS[0] not in tier
    stats = tier.stats()
    assert (stats.corrupt, stats.entries, stats.bytes) == (1, 1, FILE_BYTES)
    assert_kv_equal(tier.get(KEYS[1]), make_kv(seed=1))


@pytest.mark.parametrize(
    "damage", ["flipped_header_byte", "truncated", "wrong_version", "other_model"]
)
def test_restart_drops_entries_with_bad_headers(tmp_path: Path, damage: str) -> None:
    tier = _tier(tmp_path)
    tier.put(KEYS[0], make_kv())
    tier.put(KEYS[1], make_kv(seed=1))
    DAMAGES[damage](tier.file_path(KEYS[0]))
    reopened = _tier(tmp_path)
    assert reopened.keys_lru_first() == [KEYS[1]]
    assert reopened.stats().corrupt == 1
    assert not tier.file_path(KEYS[0]).exists()


def test_file_deleted_behind_the_index_is_a_miss(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.put(KEYS[0], make_kv())
    tier.file_path(KEYS[0]).unlink()
    assert tier.get(KEYS[0]) is None
    assert KEYS[0] not in tier and tier.stats().corrupt == 0


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_restart_removes_stale_temp_files_but_not_live_ones(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.put(KEYS[0], make_kv())
    folder = tier.file_path(KEYS[0]).parent
    stale = folder / f".{KEYS[0]}.{_dead_pid()}.abc123.tmp"
    live = folder / f".{KEYS[1]}.{os.getpid()}.def456.tmp"
    stale.write_bytes(b"half an entry")
    live.write_bytes(b"being written")
    reopened = _tier(tmp_path)
    assert not stale.exists() and live.exists()
    assert reopened.keys_lru_first() == [KEYS[0]]


@pytest.mark.parametrize("failing", ["write", "fsync"])
def test_failed_write_raises_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    tier = _tier(tmp_path)
    tier.put(KEYS[0], make_kv())
    real, calls = getattr(os, failing), []

    def disk_full(fd: int, *args: object) -> object:
        calls.append(fd)
        # write: the second call, mid-entry (the header went through); fsync: the file's own.
        if (len(calls) == 2) if failing == "write" else stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, *args)

    monkeypatch.setattr(os, failing, disk_full)
    with pytest.raises(OSError, match="No space"):
        tier.put(KEYS[1], make_kv(seed=1))
    monkeypatch.undo()
    assert tier.keys_lru_first() == [KEYS[0]]
    assert _entry_files(tmp_path) == [tier.file_path(KEYS[0])]
    assert _temp_files(tmp_path) == []


def test_check_reconciles_index_and_folder(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for i in range(3):
        tier.put(KEYS[i], make_kv(seed=i))
    tier.file_path(KEYS[0]).unlink()  # gone behind the index
    _tier(tmp_path).put(KEYS[3], make_kv(seed=3))  # written by "another process"
    _flip_layer_byte(tier.file_path(KEYS[1]))  # only a data check finds this
    report = tier.check(verify_data=True)
    assert (report.dropped_missing, report.adopted_files, report.removed_corrupt) == (1, 1, 1)
    assert tier.keys_lru_first() == [KEYS[2], KEYS[3]]
    assert_kv_equal(tier.get(KEYS[3]), make_kv(seed=3))


def test_entry_larger_than_budget_is_not_written(tmp_path: Path) -> None:
    tier = _tier(tmp_path, budget_entries=1)
    assert tier.put(KEYS[0], make_kv(num_tokens=500)) == []
    assert _entry_files(tmp_path) == [] and KEYS[0] not in tier


def test_malformed_key_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="key"):
        _tier(tmp_path).put("../escape", make_kv())


def test_reads_work_on_tmpfs_with_or_without_direct_io(tmp_path: Path) -> None:
    # Older kernels refuse O_DIRECT on tmpfs (the tier then falls back); newer ones take it.
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    folder = shm / f"kvstore-test-{os.getpid()}-{tmp_path.name}"
    try:
        tier = _tier(folder)
        tier.put(KEYS[0], make_kv(dtype=torch.bfloat16))
        assert_kv_equal(tier.get(KEYS[0]), make_kv(dtype=torch.bfloat16))
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True)


def test_buffered_reads_when_direct_io_is_off(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 10 * FILE_BYTES, FINGERPRINT, direct_io=False)
    tier.put(KEYS[0], make_kv(dtype=torch.float16))
    assert_kv_equal(tier.get(KEYS[0]), make_kv(dtype=torch.float16))
    assert not tier.direct_io


def test_drop_page_cache_keeps_entries_readable(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.put(KEYS[0], make_kv())
    tier.drop_page_cache()
    tier.drop_page_cache(KEYS[0])
    assert_kv_equal(tier.get(KEYS[0]), make_kv())


# -- encodings -----------------------------------------------------------------------------------

COMPRESSED = ["fp8_e4m3", "int8"]


def _close(actual: torch.Tensor, expected: torch.Tensor, encoding: str) -> bool:
    bound = {"fp8_e4m3": 0.04, "int8": 0.01}[encoding]
    return float((actual.float() - expected.float()).norm() / expected.float().norm()) < bound


@pytest.mark.parametrize("encoding", COMPRESSED)
def test_encoded_entries_read_back_in_their_original_dtype(
    tmp_path: Path, dtype: torch.dtype, encoding: str
) -> None:
    tier = SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding=encoding)
    kv = make_kv(seed=11, dtype=dtype, num_tokens=40, head_dim=16)
    tier.put(KEYS[0], kv)
    back = tier.get(KEYS[0])
    assert back is not None and back.keys.dtype == dtype and back.keys.shape == kv.keys.shape
    expected = codec.round_trip(kv, encoding)
    assert torch.equal(back.keys, expected.keys) and torch.equal(back.values, expected.values)
    assert _close(back.keys, kv.keys, encoding) and _close(back.values, kv.values, encoding)


@pytest.mark.parametrize("encoding", COMPRESSED)
def test_open_reads_quantized_layers_as_views_of_one_buffer(tmp_path: Path, encoding: str) -> None:
    tier = SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding=encoding)
    kv = make_kv(seed=12, dtype=torch.bfloat16)
    tier.put(KEYS[0], kv)
    reader = tier.open(KEYS[0])
    assert reader is not None and reader.header.encoding == encoding
    try:
        pairs = [reader.read_layer(i) for i in range(reader.num_layers - 1)]
        assert reader.chunk_kv() is None  # not every layer read yet
        pairs.append(reader.read_layer(reader.num_layers - 1))
        whole = reader.chunk_kv()
    finally:
        reader.close()
    assert all(isinstance(p, QuantizedPair) for p in pairs)
    storages = {t.untyped_storage().data_ptr() for p in pairs for t in (p.k, p.v, p.k_scale)}
    assert len(storages) == 1  # every payload and scale is a view of the entry's read buffer
    assert whole is not None and whole.keys.dtype == torch.bfloat16
    for i, pair in enumerate(pairs):
        k, v = pair.dequantize()
        assert torch.equal(k, whole.keys[i]) and torch.equal(v, whole.values[i])


def test_open_reads_unencoded_layers_as_plain_pairs(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.put(KEYS[0], make_kv(seed=13))
    reader = tier.open(KEYS[0])
    assert reader is not None
    try:
        k, v = reader.read_layer(0)
    finally:
        reader.close()
    assert torch.equal(k, make_kv(seed=13).keys[0]) and torch.equal(v, make_kv(seed=13).values[0])
    assert tier.open(KEYS[1]) is None and tier.stats().misses == 1


def test_a_tier_reads_entries_of_every_encoding_whatever_it_writes(tmp_path: Path) -> None:
    for i, encoding in enumerate(codec.ENCODINGS):
        SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding=encoding).put(KEYS[i], make_kv(seed=i))
    tier = SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding="int8")
    assert tier.keys_lru_first() == KEYS[:3]
    for i, encoding in enumerate(codec.ENCODINGS):
        expected = codec.round_trip(make_kv(seed=i), encoding)
        assert_kv_equal(tier.get(KEYS[i]), expected)


@pytest.mark.parametrize(("dtype", "ratio"), [(torch.float32, 0.25), (torch.bfloat16, 0.5)])
@pytest.mark.parametrize("encoding", COMPRESSED)
def test_compressed_entries_take_a_quarter_of_fp32_and_half_of_bf16_bytes(
    tmp_path: Path, dtype: torch.dtype, ratio: float, encoding: str
) -> None:
    kv = make_kv(dtype=dtype, num_layers=2, num_kv_heads=4, num_tokens=256, head_dim=64)
    plain = SSDTier(tmp_path / "plain", 1 << 30, FINGERPRINT)
    small = SSDTier(tmp_path / "small", 1 << 30, FINGERPRINT, encoding=encoding)
    plain.put(KEYS[0], kv)
    small.put(KEYS[0], kv)
    assert small.stats().bytes / plain.stats().bytes == pytest.approx(ratio, abs=0.02)
    assert small.file_path(KEYS[0]).stat().st_size == small.stats().bytes


def test_an_unknown_encoding_is_a_value_error_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="none, fp8_e4m3, int8"):
        SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding="fp4")


def test_kv_with_inf_is_not_written_in_a_compressed_encoding(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding="fp8_e4m3")
    kv = make_kv()
    kv.values[1, 0, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        tier.put(KEYS[0], kv)
    assert _entry_files(tmp_path) == [] and _temp_files(tmp_path) == []


@pytest.mark.parametrize("where", ["payload", "scales"])
def test_a_flipped_byte_of_an_encoded_layer_is_a_counted_miss(tmp_path: Path, where: str) -> None:
    tier = SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding="int8")
    tier.put(KEYS[0], make_kv())
    path = tier.file_path(KEYS[0])
    header = kvformat.parse_header(path.read_bytes(), FINGERPRINT, KEYS[0])
    inside = 7 if where == "payload" else header.scales_offset + header.scale_nbytes + 2
    flip_byte(path, header.layer_offset(2) + inside)
    assert tier.get(KEYS[0]) is None
    assert not path.exists() and tier.stats().corrupt == 1


def test_check_with_data_verifies_encoded_entries(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 1 << 30, FINGERPRINT, encoding="fp8_e4m3")
    tier.put(KEYS[0], make_kv(seed=0))
    tier.put(KEYS[1], make_kv(seed=1))
    path = tier.file_path(KEYS[1])
    header = kvformat.parse_header(path.read_bytes(), FINGERPRINT, KEYS[1])
    flip_byte(path, header.layer_offset(0) + header.scales_offset)
    assert tier.check(verify_data=True).removed_corrupt == 1
    assert tier.keys_lru_first() == [KEYS[0]]


def test_discard_removes_the_file_and_the_index_entry(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.put(KEYS[0], make_kv())
    assert tier.discard(KEYS[0]) is True
    assert KEYS[0] not in tier and not tier.file_path(KEYS[0]).exists()
    assert tier.stats().bytes == 0
    assert tier.discard(KEYS[0]) is False
