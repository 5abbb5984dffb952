"""Crash safety across processes: a writer killed mid-write leaves no visible entry, and two
processes writing the same key leave one valid entry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.ssd_tier import SSDTier
from tests.kvstore.kv_testutil import FINGERPRINT, assert_kv_equal, key_of, make_kv

KEY = key_of(42)

# The child writes one large entry; the hooked os function signals the parent through a marker
# file and then stalls, so the parent can SIGKILL it at that exact point of the write.
_KILLED_WRITER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from kvstore.ssd_tier import SSDTier
from tests.kvstore.kv_testutil import FINGERPRINT, make_kv

path, key, hooked, marker = sys.argv[1:5]
real = getattr(os, hooked)
calls = 0

def stalled(*args, **kwargs):
    global calls
    calls += 1
    if calls == (3 if hooked == "write" else 1):
        Path(marker).touch()
        time.sleep(60)
    return real(*args, **kwargs)

setattr(os, hooked, stalled)
tier = SSDTier(path, 1 << 30, FINGERPRINT)
tier.put(key, make_kv(num_layers=8, num_tokens=2048, head_dim=64))
"""

_RACING_WRITER = """
import os, sys, time
sys.path.insert(0, {root!r})
from kvstore.ssd_tier import SSDTier
from tests.kvstore.kv_testutil import FINGERPRINT, make_kv

path, key, seed, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tier = SSDTier(path, 1 << 30, FINGERPRINT)
kv = make_kv(seed=seed, num_layers=4, num_tokens=256, head_dim=64)
while not os.path.exists(go):
    time.sleep(0.001)
for _ in range(8):
    tier.put(key, kv)
"""

ROOT = str(Path(__file__).resolve().parents[2])


def _spawn(script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", script.format(root=ROOT), *args], cwd=ROOT)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hooked", ["write", "replace"], ids=["mid_data", "before_rename"])
def test_writer_killed_mid_write_leaves_no_visible_entry(tmp_path: Path, hooked: str) -> None:
    store, marker = tmp_path / "kv", tmp_path / "marker"
    child = _spawn(_KILLED_WRITER, str(store), KEY, hooked, str(marker))
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert child.poll() is None, "writer exited before reaching the hook"
        assert time.monotonic() < deadline, "writer never reached the hook"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert list(store.glob("*/*.kv")) == []
    assert len(list(store.glob("*/.*.tmp"))) == 1  # the half-written (or unrenamed) temp
    reopened = SSDTier(store, 1 << 30, FINGERPRINT)
    assert reopened.keys_lru_first() == [] and reopened.get(KEY) is None
    assert list(store.glob("*/.*.tmp")) == []  # stale temp of the dead writer removed


@pytest.mark.timeout(60)
def test_two_processes_writing_one_key_leave_one_valid_entry(tmp_path: Path) -> None:
    store, go = tmp_path / "kv", tmp_path / "go"
    writers = [_spawn(_RACING_WRITER, str(store), KEY, str(seed), str(go)) for seed in (1, 2)]
    time.sleep(0.5)  # let both import and wait at the start line
    go.touch()
    assert [w.wait(timeout=50) for w in writers] == [0, 0]
    assert len(list(store.glob("*/*.kv"))) == 1
    assert list(store.glob("*/.*.tmp")) == []
    tier = SSDTier(store, 1 << 30, FINGERPRINT)
    got = tier.get(KEY)
    assert got is not None and tier.stats().corrupt == 0
    candidates = [make_kv(seed=s, num_layers=4, num_tokens=256, head_dim=64) for s in (1, 2)]
    matches = 0
    for candidate in candidates:
        try:
            assert_kv_equal(got, candidate)
            matches += 1
        except AssertionError:
            pass
    assert matches == 1
