"""The layer streamer: a background thread loads layer i of every present chunk up to
`lookahead` layers ahead of the consumer, so loading overlaps the blender's compute."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvstore.device_time import DeviceSpan, mark
from kvstore.errors import KVEntryError, KVStreamError
from kvstore.staging import (
    StagingRing,
    StagingRings,
    chunk_of_each_token,
    item_tensors,
    join,
    move_to_device,
)
from kvstore.tiers import LayerItem, LayerSource
from kvstore.types import NO_CHUNKS, LayerKV, LayerLoad, StreamStats

logger = logging.getLogger(__name__)


def _nbytes(item: LayerItem) -> int:
    return sum(t.nbytes for t in item_tensors(item))


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

    A layer reaches the consumer as one LayerKV: the present chunks' keys and values joined
    into one tensor pair, built in a number of calls that does not grow with the chunks
    (kvstore/staging.py). Off the CPU, its host tensors move in at most two copies on a
    dedicated stream (pinned ones straight to the device, the others through a pinned staging
    slab), and `layer(i)` makes the consumer's stream wait on the end of that work. Tensors
    already on the device (the gpu tier) are not copied. Compressed layers (`QuantizedPair`)
    travel compressed and are dequantized on the device. `coalesce=True` takes the staged
    path on the CPU too (the store's `stage_kv`: tests, benchmarks); otherwise a CPU layer is
    joined from the tier's tensors (a single chunk: its views).

    If a layer cannot be read (I/O error, checksum mismatch), `layer(i)` raises KVStreamError
    for that layer and every later one; earlier layers were valid, and `on_error` gets the
    source that failed and the cause (the store has that source's tier delete a corrupt
    entry). When the stream finishes, whether every layer was read or not, `on_finish` gets
    the sources and the layers read and takes over closing them (the store promotes SSD and
    remote entries, completing a partial read); without it they are closed. `close()` stops
    loading promptly whatever the consumer did and never waits on other streams; always close
    (or use `with`). `timings` and `stats` stay valid after close. A stream opened `parked`
    (for a request still queued: its lookups done, off the engine thread) loads nothing until
    `start()` or its first `layer()`.
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
        parked: bool = False,
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
        self._ready: dict[int, LayerKV] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._chunk_indices: dict[tuple[int, ...], torch.Tensor] = {}
        self._error: KVStreamError | None = None
        self._closed = False
        # Opened ahead of its prefill (a queued request): nothing loads until `start()`.
        self._parked = parked
        self._staging: StagingRing | None = (
            self._loader.staging.for_device(self.device) if self.coalesce else None
        )
        self._copy_stream = self._staging.copy_stream if self._staging is not None else None
        if live:
            self._loader.add(self)

    # -- consumer side ---------------------------------------------------------------------

    def start(self) -> None:
        """Let the loader load a stream opened `parked` (its prefill is about to run)."""
        with self._cond:
            if self._parked:
                self._parked = False
                self._cond.notify_all()

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

    def layer(self, index: int) -> LayerKV:
        """Layer `index` of every present chunk on `device`: keys and values [H_kv, N, D], the
        chunks' tokens in request order (NO_CHUNKS when none is present).

        Blocks until loaded. Raises ValueError when asked out of order (or below the first
        layer), KVStreamError when the layer could not be loaded or the stream was closed.
        """
        if index < self._next_layer or (self._has_sources and index >= self.num_layers):
            raise ValueError(f"layer {index} asked below layer {self._next_layer} or out of range")
        self._next_layer = index + 1
        if not self._has_sources:
            return NO_CHUNKS  # every chunk missed: each layer is empty
        self.start()
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
            layer = self._ready.pop(index, None)
            event = self._events.pop(index, None)
            error = self._error
        if layer is None:
            if error is not None:
                raise KVStreamError(str(error), index, error.key) from error
            raise KVStreamError(f"loader stopped before layer {index}", index)
        if event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(event)
            # Allocated on the copy stream: keep the allocator from reusing them too early.
            layer.keys.record_stream(consumer)
            layer.values.record_stream(consumer)
        return layer

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
        if self._parked:
            return None
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
        layer, span = self._to_device(items)
        timing = LayerLoad(i, start_s, time.perf_counter(), layer_bytes, span)
        with self._cond:
            self.timings.append(timing)
            self._layers_read.add(i)
            self._next_load = max(self._next_load, i + 1)
            if i >= self._first_layer:
                self._ready[i] = layer
                if span is not None:
                    assert isinstance(span.end, torch.cuda.Event)
                    self._events[i] = span.end
            self._cond.notify_all()

    def _to_device(self, items: list[LayerItem]) -> tuple[LayerKV, DeviceSpan | None]:
        """One layer's items as a LayerKV on the device, and on CUDA the span of the copy
        stream's work for it (the consumer waits on its end)."""
        if not self.coalesce:
            return join(items, self._chunk_index), None
        assert self._staging is not None
        if self._copy_stream is None:
            moved_items, moved = move_to_device(items, self.device, self._staging)
            self._count_copies(moved.copies, moved.nbytes)
            return join(moved_items, self._chunk_index), None
        with torch.cuda.stream(self._copy_stream):
            start = mark(self.device, self._copy_stream)
            moved_items, moved = move_to_device(items, self.device, self._staging)
            layer = join(moved_items, self._chunk_index)
            end = mark(self.device, self._copy_stream)
        assert isinstance(end, torch.cuda.Event)
        if moved.slab is not None:
            self._staging.copied(moved.slab, end)
        self._count_copies(moved.copies, moved.nbytes)
        return layer, DeviceSpan(start, end)

    def _chunk_index(self, lengths: tuple[int, ...]) -> torch.Tensor:
        """Each token's chunk among compressed chunks of `lengths`, built once per stream."""
        index = self._chunk_indices.get(lengths)
        if index is None:
            index = self._chunk_indices[lengths] = chunk_of_each_token(lengths, self.device)
        return index

    def _count_copies(self, copies: int, nbytes: int) -> None:
        self.stats.device_copies += copies
        self.stats.device_copy_bytes += nbytes if copies else 0

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
