"""The layer streamer: a background thread loads layer i of every present chunk up to
`lookahead` layers ahead of the consumer, so loading overlaps the blender's compute."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvstore.errors import KVEntryError, KVStreamError
from kvstore.staging import StagingRing, StagingRings, pack, packed_size, unpack
from kvstore.tiers import KVPair, LayerItem, LayerSource
from kvstore.types import LayerLoad, StreamStats

logger = logging.getLogger(__name__)


def _item_tensors(item: LayerItem) -> list[torch.Tensor]:
    if isinstance(item, tuple):
        return list(item)
    return [item.k, item.v, item.k_scale, item.v_scale]


def _with_tensors(item: LayerItem, tensors: list[torch.Tensor]) -> LayerItem:
    if isinstance(item, tuple):
        return tensors[0], tensors[1]
    k, v, k_scale, v_scale = tensors
    return dataclasses.replace(item, k=k, v=v, k_scale=k_scale, v_scale=v_scale)


def _nbytes(item: LayerItem) -> int:
    return sum(t.nbytes for t in _item_tensors(item))


class Loader:
    """One loader thread for many streams: it loads one layer at a time for the oldest open
    stream whose lookahead window allows one, so the streams of a whole scheduler step (and
    of requests queued behind it) share one thread and one I/O queue, and a stream opened
    ahead of its prefill has its first layers ready when that prefill starts.

    Streams share the loader's condition variable and, since the thread copies one layer at
    a time, its staging rings and copy streams. The thread starts with the first stream and
    exits when `stop()` is called and no stream is left.
    """

    def __init__(self, name: str = "kv-loader") -> None:
        self.name = name
        self.cond = threading.Condition()
        self.staging = StagingRings()
        self._streams: list[KVLayerStream] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    def add(self, stream: KVLayerStream) -> None:
        with self.cond:
            if self._stopping:
                raise RuntimeError("the KV loader was stopped")
            self._streams.append(stream)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self.cond.notify_all()

    def stop(self) -> None:
        """Refuse new streams and let the thread exit once every stream is finished; waits for
        it only when none is left open (an unclosed stream must not hang the caller)."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
            thread = self._thread
            idle = all(s.finished for s in self._streams)
        if thread is not None and idle:
            thread.join()

    def _run(self) -> None:
        while True:
            with self.cond:
                while True:
                    self._streams = [s for s in self._streams if not s.finished]
                    work = next(
                        ((s, a) for s in self._streams if (a := s.next_action()) is not None),
                        None,
                    )
                    if work is not None:
                        break
                    if self._stopping and not self._streams:
                        return
                    self.cond.wait()
                stream, action = work
                stream.busy = True
            stream.run(action)


# What the loader does next for a stream: load that layer, or finish the stream.
FINISH = -1


class KVLayerStream:
    """Implements `kvstore.types.LayerStream` over a list of sources (None = a missed chunk).

    A `Loader` thread (the store's, shared by every stream; or one of its own) loads layer j
    only once the consumer has asked for layer j - lookahead, so at most `lookahead` layers
    wait beyond the one being computed. It never loads layers below `first_layer` (raised
    later by `skip_to`), which the consumer will not read.

    Off the CPU, a layer's host tensors of every chunk are packed into one staging slab (a
    ring of pinned buffers on CUDA) and reach the device in ONE copy on a dedicated stream;
    `layer(i)` makes the consumer's stream wait on that copy's event. Tensors already on the
    device (the gpu tier) are not copied at all. Compressed layers (`QuantizedPair`) travel
    compressed and are dequantized on the device. `coalesce=True` forces the staged copy on
    the CPU too (tests); otherwise CPU layers are views of the tier's tensors.

    If a layer cannot be read (I/O error, checksum mismatch), `layer(i)` raises KVStreamError
    for that layer and every later one; earlier layers were valid, and `on_error` gets the
    source that failed and the cause (the store has that source's tier delete a corrupt
    entry). When the stream finishes, whether every layer was read or not, `on_finish` gets
    the sources and the layers read and takes over closing them (the store promotes SSD and
    remote entries, completing a partial read); without it they are closed. `close()` stops
    loading promptly whatever the consumer did and never waits on other streams; always close
    (or use `with`). `timings` and `stats` stay valid after close.
    """

    def __init__(
        self,
        sources: Sequence[LayerSource | None],
        device: torch.device | str = "cpu",
        lookahead: int = 2,
        read_delay_s: float = 0.0,
        on_finish: Callable[[list[LayerSource], set[int]], None] | None = None,
        on_error: Callable[[LayerSource, BaseException], None] | None = None,
        first_layer: int = 0,
        coalesce: bool | None = None,
        loader: Loader | None = None,
    ) -> None:
        live = [s for s in sources if s is not None]
        layer_counts = {s.num_layers for s in live}
        if lookahead < 0 or read_delay_s < 0 or first_layer < 0 or len(layer_counts) > 1:
            for source in live:
                source.close()
            raise ValueError(
                f"need lookahead >= 0, read_delay_s >= 0, first_layer >= 0 and one layer count,"
                f" got {lookahead=} {read_delay_s=} {first_layer=} layer counts"
                f" {sorted(layer_counts)}"
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.present = [s is not None for s in sources]
        self.tiers = [s.tier if s is not None else None for s in sources]
        self.timings: list[LayerLoad] = []
        self.stats = StreamStats()
        self.num_layers = layer_counts.pop() if live else 0
        self.lookahead = lookahead
        self.coalesce = self.device.type != "cpu" if coalesce is None else coalesce
        self.busy = False  # the loader is working on this stream (guarded by the loader's cond)
        self.finished = not live
        self._own_loader = loader is None and bool(live)
        self._loader = loader if loader is not None else Loader(f"kv-loader-{id(self):x}")
        self._cond = self._loader.cond
        self._sources = live
        self._has_sources = bool(live)
        self._read_delay_s = read_delay_s
        self._on_finish = on_finish
        self._on_error = on_error
        self._stop = threading.Event()
        self._first_layer = first_layer  # lowest layer the loader will still load
        self._next_load = first_layer  # next layer the loader loads
        self._requested = first_layer - 1  # highest layer the consumer asked for
        self._next_layer = first_layer  # lowest layer the consumer may still ask for
        self._layers_read: set[int] = set()
        self._ready: dict[int, list[KVPair]] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._error: KVStreamError | None = None
        self._closed = False
        self._staging: StagingRing | None = (
            self._loader.staging.for_device(self.device) if self.coalesce else None
        )
        self._copy_stream = self._staging.copy_stream if self._staging is not None else None
        if live:
            self._loader.add(self)

    # -- consumer side ---------------------------------------------------------------------

    def skip_to(self, layer: int) -> None:
        """Layers below `layer` will not be asked for: the loader skips them (any already
        loaded are dropped). A `layer` at or below the current first layer changes nothing."""
        with self._cond:
            if layer <= self._next_layer:
                return
            self._next_layer = self._first_layer = layer
            self._next_load = max(self._next_load, layer)
            self._requested = max(self._requested, layer - 1)
            for skipped in [j for j in self._ready if j < layer]:
                del self._ready[skipped]
                self._events.pop(skipped, None)
            self._cond.notify_all()

    def layer(self, index: int) -> list[KVPair]:
        """(keys, values) of `index` per present chunk, each [H_kv, n_j, D] on `device`.

        Blocks until loaded. Raises ValueError when asked out of order (or below the first
        layer), KVStreamError when the layer could not be loaded or the stream was closed.
        """
        if index < self._next_layer or (self._has_sources and index >= self.num_layers):
            raise ValueError(f"layer {index} asked below layer {self._next_layer} or out of range")
        self._next_layer = index + 1
        if not self._has_sources:
            return []  # every chunk missed: each layer is empty
        with self._cond:
            if self._closed:
                raise KVStreamError(f"stream closed before layer {index}", index)
            self._requested = index
            self._cond.notify_all()
            while index not in self._ready and not self._failed_by(index) and not self.finished:
                self._cond.wait()
            for skipped in [j for j in self._ready if j < index]:
                del self._ready[skipped]
                self._events.pop(skipped, None)
            pairs = self._ready.pop(index, None)
            event = self._events.pop(index, None)
            error = self._error
        if pairs is None:
            if error is not None:
                raise KVStreamError(str(error), index, error.key) from error
            raise KVStreamError(f"loader stopped before layer {index}", index)
        if event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(event)
            for k, v in pairs:
                # Allocated on the copy stream: keep the allocator from reusing them too early.
                k.record_stream(consumer)
                v.record_stream(consumer)
        return pairs

    def close(self) -> None:
        """Stop loading (promptly, even mid-delay), release files and buffers. Idempotent.

        Finishes the stream on the calling thread unless the loader is busy with one of its
        layers, in which case that layer is abandoned and the loader finishes it."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._cond.notify_all()
            finish_here = not self.busy and not self.finished
            if finish_here:
                self.busy = True
            while not finish_here and not self.finished:
                self._cond.wait()
        if finish_here:
            self._finish()
        with self._cond:
            self._ready.clear()
            self._events.clear()
        self._sources = []  # their read buffers: freed unless promoted or held by the consumer
        if self._own_loader:
            self._loader.stop()

    def __enter__(self) -> KVLayerStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _failed_by(self, index: int) -> bool:
        return self._error is not None and self._error.layer <= index

    # -- loader side (the loader's cond is held in next_action, not in run) ----------------

    def next_action(self) -> int | None:
        """The layer to load next, FINISH, or None when the stream must wait for its consumer."""
        if self.finished or self.busy:
            return None
        if self._closed or self._error is not None or self._next_load >= self.num_layers:
            return FINISH
        if self._requested >= self._next_load - self.lookahead:
            return self._next_load
        return None

    def run(self, action: int) -> None:
        """Do `action` on the loader thread; a bug becomes a stream error, never a hang."""
        if action == FINISH:
            self._finish()
            return
        try:
            if self._copy_stream is not None:
                with torch.cuda.device(self.device):
                    self._load(action)
            else:
                self._load(action)
        except Exception as exc:
            logger.exception("KV loader failed")
            self._fail(KVStreamError(f"loader failed: {exc}", action), exc)
        finally:
            with self._cond:
                self.busy = False
                self._cond.notify_all()

    def _finish(self) -> None:
        """Release the sources (or hand them to on_finish) and mark the stream finished."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()  # no copy may still read a host buffer we drop
        sources, read = list(self._sources), set(self._layers_read)
        try:
            if self._on_finish is not None and self._error is None:
                self._on_finish(sources, read)
                sources = []
        except Exception:
            logger.exception("KV stream finish callback failed")
        finally:
            for source in sources:
                source.close()
            with self._cond:
                self.finished = True
                self.busy = False
                self._cond.notify_all()

    def _load(self, i: int) -> None:
        start_s = time.perf_counter()
        if self._read_delay_s and self._stop.wait(self._read_delay_s):
            return
        items: list[LayerItem] = []
        layer_bytes = 0
        for source in self._sources:
            if self._stop.is_set():
                return
            try:
                item = source.read_layer(i)
            except (KVEntryError, OSError) as exc:
                error = KVStreamError(f"layer {i} of {source.key}: {exc}", i, source.key)
                self._fail(error, exc, source)
                return
            nbytes = _nbytes(item)
            self._count(source.tier, nbytes)
            layer_bytes += nbytes
            items.append(item)
        pairs, event = self._to_device(items)
        timing = LayerLoad(i, start_s, time.perf_counter(), layer_bytes)
        with self._cond:
            self.timings.append(timing)
            self._layers_read.add(i)
            self._next_load = max(self._next_load, i + 1)
            if i >= self._first_layer:
                self._ready[i] = pairs
                if event is not None:
                    self._events[i] = event
            self._cond.notify_all()

    def _to_device(self, items: list[LayerItem]) -> tuple[list[KVPair], torch.cuda.Event | None]:
        """Device pairs of one layer, and the event marking the end of their copy (CUDA)."""
        if not self.coalesce:
            return [item if isinstance(item, tuple) else item.dequantize() for item in items], None
        assert self._staging is not None
        if self._copy_stream is None:
            return self._transfer(self._staging, items)[0], None
        with torch.cuda.stream(self._copy_stream):
            pairs, slot = self._transfer(self._staging, items)
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        if slot is not None:
            self._staging.copied(slot, event)
        return pairs, event

    def _transfer(
        self, ring: StagingRing, items: list[LayerItem]
    ) -> tuple[list[KVPair], int | None]:
        """Pack every host tensor of the layer into a staging slot, copy the slot to the device
        in one piece, and rebuild the items as views of the copy (dequantized there); the
        pairs, and the slot used (None when nothing had to move)."""
        host = [t for item in items for t in _item_tensors(item) if self._must_move(t)]
        moved: list[torch.Tensor] = []
        slot = None
        if host:
            slot, staging = ring.take(packed_size(host))
            offsets = pack(host, staging)
            device_slab = staging.to(self.device, non_blocking=True, copy=True)
            moved = unpack(device_slab, offsets, host)
            self.stats.device_copies += 1
            self.stats.device_copy_bytes += staging.nbytes
        pairs, next_moved = [], iter(moved)
        for item in items:
            tensors = [next(next_moved) if self._must_move(t) else t for t in _item_tensors(item)]
            rebuilt = _with_tensors(item, tensors)
            pairs.append(rebuilt if isinstance(rebuilt, tuple) else rebuilt.dequantize())
        return pairs, slot

    def _must_move(self, tensor: torch.Tensor) -> bool:
        """Host tensors move; device-resident ones (the gpu tier) are used in place. On the
        CPU, a coalesced stream copies everything (the path tests cover)."""
        return tensor.device != self.device or self.device.type == "cpu"

    def _count(self, tier: str, nbytes: int) -> None:
        stats = self.stats
        stats.bytes_by_tier[tier] = stats.bytes_by_tier.get(tier, 0) + nbytes

    def _fail(
        self, error: KVStreamError, cause: BaseException, source: LayerSource | None = None
    ) -> None:
        logger.warning("KV stream failed at layer %d: %s", error.layer, error)
        with self._cond:
            self._error = error
            self._cond.notify_all()
        if source is not None and self._on_error is not None:
            self._on_error(source, cause)
