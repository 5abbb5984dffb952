"""Layer streaming: exact data from both tiers, real overlap of loading and compute bounded by
the lookahead, prompt close, the documented error on a corrupt layer, and promotion."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore import codec, tiers
from kvstore import format as kvformat
from kvstore.errors import KVStreamError
from kvstore.loader import KVLayerStream, Loader
from kvstore.store import KVStore, KVStoreConfig
from kvstore.tiers import MemorySource
from tests.kvstore.kv_testutil import FINGERPRINT, assert_kv_equal, flip_byte, key_of, make_kv

pytestmark = pytest.mark.timeout(30)  # a hang is a failure, not a stuck run

KEYS = [key_of(i) for i in range(8)]


def _store(tmp_path: Path, memory_entries: int = 100, lookahead: int = 2) -> KVStore:
    return KVStore(
        KVStoreConfig(
            model_fingerprint=FINGERPRINT,
            memory_budget_bytes=memory_entries * make_kv().nbytes * 4,
            ssd_path=tmp_path / "kv",
            ssd_budget_bytes=1 << 30,
            lookahead=lookahead,
        )
    )


def _put_on_ssd_only(store: KVStore, key: str, kv) -> None:
    store.put(key, kv)
    store.flush()
    store.tier(tiers.MEMORY).discard(key)


def _loader_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def _open_entry_fds(folder: Path) -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [t for t in targets if t.startswith(str(folder))]


def test_stream_delivers_exact_layers_from_memory_and_ssd(tmp_path: Path, dtype) -> None:
    with _store(tmp_path) as store:
        in_memory = make_kv(seed=1, dtype=dtype, num_tokens=3)
        on_ssd = make_kv(seed=2, dtype=dtype, num_tokens=9)
        store.put(KEYS[0], in_memory)
        _put_on_ssd_only(store, KEYS[1], on_ssd)
        with store.open_stream([KEYS[1], KEYS[2], KEYS[0]]) as stream:
            assert stream.present == [True, False, True]
            assert stream.tiers == ["ssd", None, "memory"]
            for i in range(on_ssd.num_layers):
                (k_ssd, v_ssd), (k_mem, v_mem) = stream.layer(i)
                assert k_ssd.shape == (2, 9, 8) and k_mem.shape == (2, 3, 8)
                assert torch.equal(k_ssd, on_ssd.keys[i]) and torch.equal(v_ssd, on_ssd.values[i])
                assert torch.equal(k_mem, in_memory.keys[i])
                assert torch.equal(v_mem, in_memory.values[i])
        layer_bytes = (on_ssd.nbytes + in_memory.nbytes) // on_ssd.num_layers
        assert [t.layer for t in stream.timings] == list(range(on_ssd.num_layers))
        assert all(t.bytes_loaded == layer_bytes for t in stream.timings)
        assert stream.stats.bytes_by_tier == {"ssd": on_ssd.nbytes, "memory": in_memory.nbytes}


@pytest.mark.parametrize("lookahead", [1, 2])
def test_loading_overlaps_compute_and_never_runs_more_than_lookahead_ahead(
    tmp_path: Path, lookahead: int
) -> None:
    delay_s = compute_s = 0.02
    num_layers = 8
    with _store(tmp_path, lookahead=lookahead) as store:
        for j in range(2):
            _put_on_ssd_only(store, KEYS[j], make_kv(seed=j, num_layers=num_layers))
        asked, compute_start, compute_end = [], [], []
        with store.open_stream(KEYS[:2], read_delay_s=delay_s) as stream:
            for i in range(num_layers):
                asked.append(time.perf_counter())
                stream.layer(i)
                compute_start.append(time.perf_counter())
                time.sleep(compute_s)  # the blender's recompute of layer i
                compute_end.append(time.perf_counter())
        loads = stream.timings
    # Overlap: layer i's compute started before the loader finished layer i + lookahead, i.e.
    # that load ran while layer i was being computed (for lookahead 1: layer i + 1).
    for i in range(num_layers - lookahead):
        assert compute_start[i] < loads[i + lookahead].load_end_s, i
    # Bound: layer j is started only after the consumer asked for layer j - lookahead.
    for j in range(lookahead, num_layers):
        assert loads[j].load_start_s > asked[j - lookahead], j
    assert all(t.load_end_s - t.load_start_s >= delay_s for t in loads)


@pytest.mark.parametrize("lookahead", [0, 2])
def test_fast_loader_waits_for_a_slow_consumer(tmp_path: Path, lookahead: int) -> None:
    with _store(tmp_path, lookahead=lookahead) as store:
        _put_on_ssd_only(store, KEYS[0], make_kv(num_layers=8))
        asked = []
        with store.open_stream([KEYS[0]]) as stream:
            time.sleep(0.05)  # the loader could load everything now, but may load `lookahead`
            assert len(stream.timings) <= lookahead
            for i in range(8):
                asked.append(time.perf_counter())
                stream.layer(i)
                time.sleep(0.005)
        for j in range(lookahead, 8):
            assert stream.timings[j].load_start_s > asked[j - lookahead]


def test_close_mid_stream_stops_the_loader_promptly_and_releases_files(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        for j in range(2):
            _put_on_ssd_only(store, KEYS[j], make_kv(seed=j, num_layers=8))
        stream = store.open_stream(KEYS[:2], read_delay_s=0.01)
        stream.layer(0)
        stream.layer(1)
        slow = store.open_stream(KEYS[:2], read_delay_s=30.0)  # mid-delay of its first layer
        started = time.perf_counter()
        stream.close()
        slow.close()
        assert time.perf_counter() - started < 5.0  # far below the 30 s the loader would sleep
        assert stream.finished and slow.finished
        with pytest.raises(KVStreamError):
            stream.layer(2)
        store.flush()  # the partly read entries are promoted by the store's worker
        assert _open_entry_fds(tmp_path) == []


def test_corrupt_layer_mid_stream_raises_stream_error_and_deletes_entry(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        good, bad = make_kv(seed=1, num_layers=6), make_kv(seed=2, num_layers=6)
        store.put(KEYS[0], good)
        _put_on_ssd_only(store, KEYS[1], bad)
        path = store.tier(tiers.SSD).file_path(KEYS[1])
        header = kvformat.parse_header(path.read_bytes(), FINGERPRINT, KEYS[1])
        flip_byte(path, header.layer_offset(3) + 10)
        with store.open_stream(KEYS[:2]) as stream:
            for i in range(3):
                (k_good, _), (k_bad, v_bad) = stream.layer(i)
                assert torch.equal(k_good, good.keys[i]) and torch.equal(v_bad, bad.values[i])
            for i in (3, 4):
                with pytest.raises(KVStreamError) as raised:
                    stream.layer(i)
                assert (raised.value.layer, raised.value.key) == (i, KEYS[1])
        assert stream.finished
        assert not path.exists()
        assert store.lookup(KEYS[:2]) == ["memory", None]
        assert store.stats().tiers[tiers.SSD].corrupt == 1


def test_file_truncated_while_streaming_raises_stream_error(tmp_path: Path) -> None:
    with _store(tmp_path, lookahead=0) as store:
        kv = make_kv(num_layers=5)
        _put_on_ssd_only(store, KEYS[0], kv)
        path = store.tier(tiers.SSD).file_path(KEYS[0])
        header = kvformat.parse_header(path.read_bytes(), FINGERPRINT, KEYS[0])
        with store.open_stream([KEYS[0]]) as stream:
            assert torch.equal(stream.layer(0)[0][0], kv.keys[0])
            os.truncate(path, header.layer_offset(2) + 100)  # lookahead 0: layer 1 not read yet
            assert torch.equal(stream.layer(1)[0][1], kv.values[1])
            with pytest.raises(KVStreamError, match="file ends") as raised:
                stream.layer(2)
            assert raised.value.layer == 2
        assert store.lookup([KEYS[0]]) == [None] and store.stats().tiers[tiers.SSD].corrupt == 1


def test_one_loader_thread_serves_every_open_stream_and_prefetches_the_next(
    tmp_path: Path,
) -> None:
    with _store(tmp_path, lookahead=2) as store:
        first, second = make_kv(seed=1, num_layers=6), make_kv(seed=2, num_layers=6)
        _put_on_ssd_only(store, KEYS[0], first)
        _put_on_ssd_only(store, KEYS[1], second)
        with store.open_stream([KEYS[0]]) as a, store.open_stream([KEYS[1]]) as b:
            for i in range(6):
                assert torch.equal(a.layer(i)[0][0], first.keys[i])
            # Before anyone asks `b` for a layer, its window (the first `lookahead` layers) is
            # loaded, and no more.
            deadline = time.perf_counter() + 10
            while len(b.timings) < 2 and time.perf_counter() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)
            assert {t.layer for t in b.timings} == {0, 1}
            for i in range(6):
                assert torch.equal(b.layer(i)[0][1], second.values[i])
            assert len(_loader_threads(store.loader.name)) == 1
    assert _loader_threads(store.loader.name) == []  # closing the store stops its loader


def test_a_partial_read_promotes_the_whole_entry_to_memory(tmp_path: Path, dtype) -> None:
    with _store(tmp_path) as store:
        kv = make_kv(seed=5, dtype=dtype, num_layers=6)
        _put_on_ssd_only(store, KEYS[0], kv)
        with store.open_stream([KEYS[0]], lookahead=0) as stream:
            stream.layer(0)  # one layer of six: a probe
        store.flush()
        assert store.lookup([KEYS[0]]) == [tiers.MEMORY]
        assert_kv_equal(store.tier(tiers.MEMORY).get(KEYS[0]), kv)


def test_an_entry_never_read_is_not_promoted(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        _put_on_ssd_only(store, KEYS[0], make_kv(seed=5))
        store.open_stream([KEYS[0]], read_delay_s=30.0).close()
        store.flush()
        assert store.lookup([KEYS[0]]) == [tiers.SSD]


def test_the_loader_never_loads_layers_below_the_first_layer(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        kv = make_kv(seed=3, num_layers=6)
        _put_on_ssd_only(store, KEYS[0], kv)
        with store.open_stream([KEYS[0]], first_layer=2) as stream:
            with pytest.raises(ValueError):
                stream.layer(1)
            k, v = stream.layer(2)[0]
            assert torch.equal(k, kv.keys[2]) and torch.equal(v, kv.values[2])
            stream.skip_to(4)
            assert torch.equal(stream.layer(4)[0][1], kv.values[4])
        assert {t.layer for t in stream.timings} <= {2, 3, 4, 5}
        assert 2 in {t.layer for t in stream.timings}


def test_a_coalesced_stream_moves_each_layer_in_one_copy(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        chunks = [make_kv(seed=j, num_tokens=3 + j) for j in range(4)]
        for j, kv in enumerate(chunks):
            if j % 2:
                _put_on_ssd_only(store, KEYS[j], kv)
            else:
                store.put(KEYS[j], kv)
        stream = KVLayerStream(
            [
                store.tier(tiers.MEMORY).open(KEYS[0]),
                store.tier(tiers.SSD).open(KEYS[1]),
                None,
                store.tier(tiers.MEMORY).open(KEYS[2]),
                store.tier(tiers.SSD).open(KEYS[3]),
            ],
            coalesce=True,
        )
        with stream:
            for i in range(4):
                pairs = stream.layer(i)
                for (k, v), kv in zip(pairs, chunks, strict=True):
                    assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])
                    assert k.data_ptr() != kv.keys[i].data_ptr()  # a copy, not the tier's view
        assert stream.stats.device_copies == 4
        assert stream.stats.device_copy_bytes >= sum(kv.nbytes for kv in chunks)


def test_streams_of_one_loader_share_its_staging_ring_and_stay_exact() -> None:
    small, large = make_kv(seed=1, num_tokens=2), make_kv(seed=2, num_tokens=11)
    loader = Loader("kv-loader-shared-ring")
    streams = [
        KVLayerStream([MemorySource(KEYS[j], kv)], coalesce=True, lookahead=0, loader=loader)
        for j, kv in enumerate((small, large))
    ]
    try:
        for i in range(small.num_layers):  # interleaved: the larger layer grows the shared ring
            for stream, kv in zip(streams, (small, large), strict=True):
                ((k, v),) = stream.layer(i)
                assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])
    finally:
        for stream in streams:
            stream.close()
        loader.stop()
    ring = loader.staging.for_device(torch.device("cpu"))
    assert streams[0]._staging is ring and streams[1]._staging is ring


@pytest.mark.parametrize("encoding", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("coalesce", [False, True])
def test_compressed_entries_stream_dequantized_and_promote(
    tmp_path: Path, encoding: str, coalesce: bool
) -> None:
    config = KVStoreConfig(
        model_fingerprint=FINGERPRINT,
        memory_budget_bytes=1 << 30,
        ssd_path=tmp_path / "kv",
        persistent_encoding=encoding,
    )
    kv = make_kv(seed=7, dtype=torch.bfloat16, num_tokens=128)
    expected = codec.round_trip(kv, encoding)  # exactly what the SSD tier keeps
    with KVStore(config) as store:
        _put_on_ssd_only(store, KEYS[0], kv)
        ssd = store.tier(tiers.SSD)
        stream = KVLayerStream([ssd.open(KEYS[0])], coalesce=coalesce)
        with stream:
            for i in range(kv.num_layers):
                ((k, v),) = stream.layer(i)
                assert k.dtype == torch.bfloat16
                assert torch.equal(k, expected.keys[i]) and torch.equal(v, expected.values[i])
        # Compressed bytes are what was read: one byte per value plus the scales.
        assert stream.stats.bytes_by_tier[tiers.SSD] < kv.nbytes * 0.6
        with store.open_stream([KEYS[0]]) as promoting:
            promoting.layer(0)
        store.flush()
        assert_kv_equal(store.tier(tiers.MEMORY).get(KEYS[0]), expected)


def test_full_read_promotes_ssd_entries_to_memory(tmp_path: Path, dtype) -> None:
    with _store(tmp_path) as store:
        kv = make_kv(seed=5, dtype=dtype)
        _put_on_ssd_only(store, KEYS[0], kv)
        with store.open_stream([KEYS[0]]) as stream:
            for i in range(kv.num_layers):
                stream.layer(i)
        store.flush()  # promotion runs on the store's worker thread
        assert store.lookup([KEYS[0]]) == ["memory"]
        assert_kv_equal(store.tier(tiers.MEMORY).get(KEYS[0]), kv)


def test_stream_of_missing_chunks_yields_empty_layers(tmp_path: Path) -> None:
    with _store(tmp_path) as store, store.open_stream(KEYS[:3]) as stream:
        assert stream.present == [False, False, False]
        assert [len(stream.layer(i)) for i in range(4)] == [0, 0, 0, 0]


def test_layers_asked_out_of_order_are_a_value_error(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.put(KEYS[0], make_kv())
        with store.open_stream([KEYS[0]]) as stream:
            stream.layer(1)  # skipping ahead is allowed
            with pytest.raises(ValueError):
                stream.layer(0)
            with pytest.raises(ValueError):
                stream.layer(4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pin_memory", [True, False])
def test_stream_to_cuda_is_exact_from_both_tiers(tmp_path: Path, pin_memory: bool) -> None:
    config = KVStoreConfig(
        model_fingerprint=FINGERPRINT,
        memory_budget_bytes=1 << 30,
        ssd_path=tmp_path / "kv",
        pin_memory=pin_memory,
    )
    in_memory = make_kv(seed=1, dtype=torch.bfloat16)
    on_ssd = make_kv(seed=2, dtype=torch.bfloat16, num_tokens=9)
    with KVStore(config) as store:
        store.put(KEYS[0], in_memory)
        _put_on_ssd_only(store, KEYS[1], on_ssd)
        with store.open_stream([KEYS[0], KEYS[1]], device="cuda") as stream:
            for i in range(4):
                (k_mem, v_mem), (k_ssd, v_ssd) = stream.layer(i)
                assert k_mem.is_cuda and k_ssd.is_cuda
                torch.cuda.current_stream().synchronize()
                assert torch.equal(k_mem.cpu(), in_memory.keys[i])
                assert torch.equal(v_ssd.cpu(), on_ssd.values[i])
        store.flush()
        assert store.lookup([KEYS[1]]) == ["memory"]
        assert store.tier(tiers.MEMORY).get(KEYS[1]).keys.is_pinned() == pin_memory


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("encoding", ["none", "int8", "fp8_e4m3"])
def test_cuda_layers_arrive_in_two_copies_at_most_and_gpu_hits_in_none(
    tmp_path: Path, encoding: str
) -> None:
    config = KVStoreConfig(
        model_fingerprint=FINGERPRINT,
        memory_budget_bytes=1 << 30,
        ssd_path=tmp_path / "kv",
        pin_memory=True,
        gpu_budget_bytes=1 << 30,
        device="cuda",
        persistent_encoding=encoding,
    )
    chunks = [make_kv(seed=j, dtype=torch.bfloat16, num_tokens=64 + j) for j in range(3)]
    with KVStore(config) as store:
        store.put(KEYS[0], chunks[0])  # host memory, pinned
        _put_on_ssd_only(store, KEYS[1], chunks[1])  # SSD, maybe compressed
        store.put_local(KEYS[2], chunks[2])  # the gpu tier
        expected = [chunks[0], codec.round_trip(chunks[1], encoding), chunks[2]]
        with store.open_stream(KEYS[:3], device="cuda") as stream:
            assert stream.tiers == [tiers.MEMORY, tiers.SSD, tiers.GPU]
            for i in range(4):
                pairs = stream.layer(i)
                torch.cuda.current_stream().synchronize()
                for (k, v), kv in zip(pairs, expected, strict=True):
                    assert k.is_cuda and k.dtype == torch.bfloat16
                    assert torch.equal(k.cpu(), kv.keys[i]) and torch.equal(v.cpu(), kv.values[i])
        # Per layer: the pinned host chunk straight to the device, the SSD one through the
        # staging slab: two copies, whatever the number of chunks.
        assert stream.stats.device_copies == 2 * 4
        gpu_kv = store.tier(tiers.GPU).get(KEYS[2])
        with store.open_stream([KEYS[2]], device="cuda") as gpu_only:
            k, _ = gpu_only.layer(0)[0]
            assert k.data_ptr() == gpu_kv.keys[0].data_ptr()
        assert gpu_only.stats.device_copies == 0


@pytest.mark.parametrize("memory_entries", [0, 100])
def test_promotion_reads_the_rest_only_when_host_memory_can_keep_the_entry(
    tmp_path: Path, memory_entries: int
) -> None:
    with _store(tmp_path, memory_entries=memory_entries) as store:
        kv = make_kv(seed=8, num_layers=6)
        _put_on_ssd_only(store, KEYS[0], kv)
        path = store.tier(tiers.SSD).file_path(KEYS[0])
        header = kvformat.parse_header(path.read_bytes(), FINGERPRINT, KEYS[0])
        flip_byte(path, header.layer_offset(4) + 10)  # a bad layer the stream never reads
        with store.open_stream([KEYS[0]], lookahead=0) as stream:
            stream.layer(0)
        store.flush()
        corrupt = store.stats().tiers[tiers.SSD].corrupt
        if memory_entries:  # the promotion read layer 4, found it bad, and dropped the entry
            assert corrupt == 1 and store.lookup([KEYS[0]]) == [None]
        else:  # nothing could be kept, so nothing more was read
            assert corrupt == 0 and store.lookup([KEYS[0]]) == [tiers.SSD]


@pytest.mark.parametrize("num_chunks", [2, 8])
def test_a_staged_layer_is_one_tensor_pair_moved_in_one_copy_whatever_the_chunks(
    num_chunks: int,
) -> None:
    chunks = [make_kv(seed=j, num_tokens=3 + j) for j in range(num_chunks)]
    sources = [MemorySource(KEYS[j], kv) for j, kv in enumerate(chunks)]
    with KVLayerStream(sources, coalesce=True) as stream:
        for i in range(4):
            layer = stream.layer(i)
            assert layer.lengths == tuple(kv.num_tokens for kv in chunks)
            assert torch.equal(layer.keys, torch.cat([kv.keys[i] for kv in chunks], dim=1))
            assert torch.equal(layer.values, torch.cat([kv.values[i] for kv in chunks], dim=1))
    assert stream.stats.device_copies == 4  # one per layer, not one per chunk


@pytest.mark.parametrize("coalesce", [False, True])
def test_chunks_of_two_encodings_and_plain_ones_join_exactly_in_request_order(
    tmp_path: Path, coalesce: bool
) -> None:
    chunks = [make_kv(seed=j, dtype=torch.bfloat16, num_tokens=5 + 3 * j) for j in range(5)]
    encodings = ["int8", "none", "fp8_e4m3", "int8", "none"]
    for encoding in ("int8", "fp8_e4m3"):  # a restart between two encodings, one SSD folder
        config = KVStoreConfig(
            model_fingerprint=FINGERPRINT,
            ssd_path=tmp_path / "kv",
            persistent_encoding=encoding,
        )
        with KVStore(config) as store:
            for j, kv in enumerate(chunks):
                if encodings[j] == encoding:
                    _put_on_ssd_only(store, KEYS[j], kv)
    expected = [codec.round_trip(kv, e) for kv, e in zip(chunks, encodings, strict=True)]
    with KVStore(KVStoreConfig(model_fingerprint=FINGERPRINT, ssd_path=tmp_path / "kv")) as store:
        ssd = store.tier(tiers.SSD)
        sources = [
            ssd.open(KEYS[j]) if encodings[j] != "none" else MemorySource(KEYS[j], kv)
            for j, kv in enumerate(chunks)
        ]
        with KVLayerStream(sources, coalesce=coalesce) as stream:
            for i in range(4):
                layer = stream.layer(i)
                assert layer.keys.dtype == torch.bfloat16
                want = torch.cat([kv.keys[i] for kv in expected], dim=1)
                assert torch.equal(layer.keys, want)
                assert torch.equal(layer.values, torch.cat([kv.values[i] for kv in expected], 1))
                for (k, _), kv in zip(layer, expected, strict=True):
                    assert torch.equal(k, kv.keys[i])
