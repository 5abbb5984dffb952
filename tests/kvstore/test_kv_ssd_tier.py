"""The SSD tier: round trip, exact LRU eviction, restart rebuild, every kind of bad entry as a
counted miss with its file deleted, failed writes leaving nothing, and check()."""

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

from kvstore import format as kvformat
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
        kvformat.write_entry(fd, *kvformat.build_header(path.name[:-3], "another-model", kv), kv)
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
