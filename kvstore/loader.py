"""The layer streamer: a background thread loads layer i of every present chunk up to
`lookahead` layers ahead of the consumer, so loading overlaps the blender's compute."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvstore.errors import KVEntryError, KVStreamError
from kvstore.types import ChunkKV, LayerLoad, StreamStats

logger = logging.getLogger(__name__)

KVPair = tuple[torch.Tensor, torch.Tensor]
# Pinned staging slots on CUDA. A slot is reused two layers later; its previous host->device copy
# (tens of GB/s) has long finished by then, and waiting on that layer's event makes it certain.
RING_SLOTS = 2


class LayerSource(Protocol):
    """One present chunk as the loader reads it; `read_layer` may raise KVEntryError/OSError."""

    key: str
    tier: str
    num_layers: int

    def read_layer(self, layer: int) -> KVPair: ...

    def close(self) -> None: ...


class MemorySource:
    """A chunk held by the memory tier: a layer is a pair of views, no copy."""

    tier = "memory"

    def __init__(self, key: str, kv: ChunkKV) -> None:
        self.key = key
        self.kv = kv
        self.num_layers = kv.num_layers

    def read_layer(self, layer: int) -> KVPair:
        return self.kv.layer(layer)

    def close(self) -> None:
        """Nothing to release; the tier owns the tensors."""


class KVLayerStream:
    """Implements `kvstore.types.LayerStream` over a list of sources (None = a missed chunk).

    The loader thread starts layer j only once the consumer has asked for layer j - lookahead,
    so at most `lookahead` layers wait beyond the one being computed. On CUDA each layer is
    staged through a ring of pinned host buffers (unless already pinned), copied on a dedicated
    stream, and `layer(i)` makes the consumer's current stream wait on that layer's event.

    If a layer cannot be read (I/O error, checksum mismatch), `layer(i)` raises KVStreamError
    for that layer and every later one; earlier layers were valid, and `on_error` gets the key
    and the cause (the store deletes a corrupt entry). After the last layer, `on_complete` gets
    the sources (the store promotes SSD entries). `close()` stops the loader promptly whatever
    the consumer did; always close (or use `with`).
    """

    def __init__(
        self,
        sources: Sequence[LayerSource | None],
        device: torch.device | str = "cpu",
        lookahead: int = 2,
        read_delay_s: float = 0.0,
        on_complete: Callable[[list[LayerSource]], None] | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        live = [s for s in sources if s is not None]
        layer_counts = {s.num_layers for s in live}
        if lookahead < 0 or read_delay_s < 0 or len(layer_counts) > 1:
            for source in live:
                source.close()
            raise ValueError(
                f"need lookahead >= 0, read_delay_s >= 0 and one layer count, got {lookahead=}"
                f" {read_delay_s=} layer counts {sorted(layer_counts)}"
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
        self._sources = live
        self._has_sources = bool(live)
        self._read_delay_s = read_delay_s
        self._on_complete = on_complete
        self._on_error = on_error
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._requested = -1  # highest layer the consumer asked for
        self._next_layer = 0  # lowest layer the consumer may still ask for
        self._ready: dict[int, list[KVPair]] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._ring: list[torch.Tensor] = []  # pinned uint8 slots, allocated at the first layer
        self._slot_events: list[torch.cuda.Event | None] = [None] * RING_SLOTS
        self._error: KVStreamError | None = None
        self._loader_done = not live
        self._closed = False
        self._copy_stream = (
            torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        )
        self._thread = threading.Thread(target=self._run, name="kv-layer-loader", daemon=True)
        if live:
            self._thread.start()

    # -- consumer side ---------------------------------------------------------------------

    def layer(self, index: int) -> list[KVPair]:
        """(keys, values) of `index` per present chunk, each [H_kv, n_j, D] on `device`.

        Blocks until loaded. Raises ValueError when asked out of order, KVStreamError when the
        layer could not be loaded or the stream was closed.
        """
        if index < self._next_layer or (self._has_sources and index >= self.num_layers):
            raise ValueError(f"layer {index} asked after {self._next_layer - 1} or out of range")
        self._next_layer = index + 1
        if not self._has_sources:
            return []  # every chunk missed: each layer is empty
        with self._cond:
            if self._closed:
                raise KVStreamError(f"stream closed before layer {index}", index)
            self._requested = index
            self._cond.notify_all()
            while index not in self._ready and not self._failed_by(index) and not self._loader_done:
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
        """Stop the loader (promptly, even mid-delay), release files and buffers. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        with self._cond:
            self._ready.clear()
            self._events.clear()
        self._sources = []  # their read buffers: freed unless promoted or held by the consumer

    def __enter__(self) -> KVLayerStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _failed_by(self, index: int) -> bool:
        return self._error is not None and self._error.layer <= index

    # -- loader side -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._copy_stream is not None:
                with torch.cuda.device(self.device):
                    self._load_all()
            else:
                self._load_all()
        except Exception as exc:  # a bug must surface as a stream error, never as a hang
            logger.exception("KV loader failed")
            self._fail(KVStreamError(f"loader failed: {exc}", self._next_unloaded()), exc)
        finally:
            if self._copy_stream is not None:
                self._copy_stream.synchronize()  # no copy may still read a host buffer we drop
            for source in self._sources:
                source.close()
            with self._cond:
                self._loader_done = True
                self._cond.notify_all()

    def _next_unloaded(self) -> int:
        return len(self.timings)

    def _load_all(self) -> None:
        for i in range(self.num_layers):
            with self._cond:
                while not self._stop.is_set() and self._requested < i - self.lookahead:
                    self._cond.wait()
            if self._stop.is_set():
                return
            start_s = time.perf_counter()
            if self._read_delay_s and self._stop.wait(self._read_delay_s):
                return
            pairs, layer_bytes = [], 0
            for source in self._sources:
                try:
                    k, v = source.read_layer(i)
                except (KVEntryError, OSError) as exc:
                    message = f"layer {i} of {source.key}: {exc}"
                    self._fail(KVStreamError(message, i, source.key), exc)
                    return
                self._count(source.tier, k.nbytes + v.nbytes)
                layer_bytes += k.nbytes + v.nbytes
                pairs.append((k, v))
            event = None
            if self._copy_stream is not None:
                pairs, event = self._copy_to_device(i, pairs)
            timing = LayerLoad(i, start_s, time.perf_counter(), layer_bytes)
            with self._cond:
                self.timings.append(timing)
                self._ready[i] = pairs
                if event is not None:
                    self._events[i] = event
                self._cond.notify_all()
        if self._on_complete is not None:
            self._on_complete(list(self._sources))

    def _copy_to_device(
        self, layer: int, host_pairs: list[KVPair]
    ) -> tuple[list[KVPair], torch.cuda.Event]:
        """Enqueue the copies of one layer on the copy stream; returns device pairs and the
        event that marks their completion."""
        assert self._copy_stream is not None
        slot = layer % RING_SLOTS
        staged = self._stage(slot, host_pairs)
        with torch.cuda.stream(self._copy_stream):
            device_pairs = [
                (k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True))
                for k, v in staged
            ]
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        self._slot_events[slot] = event
        return device_pairs, event

    def _stage(self, slot: int, host_pairs: list[KVPair]) -> list[KVPair]:
        """Copy pageable tensors (e.g. SSD reads) into a pinned ring slot, so that the device
        copy is asynchronous; pinned ones (the memory tier with pin_memory) pass through."""
        pageable = [t for pair in host_pairs for t in pair if not t.is_pinned()]
        if not pageable:
            return host_pairs
        nbytes = sum(t.nbytes for t in pageable)  # the same for every layer of this stream
        if not self._ring:
            self._ring = [
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(RING_SLOTS)
            ]
        previous = self._slot_events[slot]
        if previous is not None:
            previous.synchronize()  # the copy that last read this slot is done
        offset, staged = 0, []
        for k, v in host_pairs:
            pair = []
            for t in (k, v):
                if t.is_pinned():
                    pair.append(t)
                    continue
                pinned = self._ring[slot][offset : offset + t.nbytes].view(t.dtype).view(t.shape)
                pinned.copy_(t)
                offset += t.nbytes
                pair.append(pinned)
            staged.append((pair[0], pair[1]))
        return staged

    def _count(self, tier: str, nbytes: int) -> None:
        stats = self.stats
        stats.bytes_by_tier[tier] = stats.bytes_by_tier.get(tier, 0) + nbytes

    def _fail(self, error: KVStreamError, cause: BaseException) -> None:
        logger.warning("KV stream failed at layer %d: %s", error.layer, error)
        with self._cond:
            self._error = error
            self._cond.notify_all()
        if error.key is not None and self._on_error is not None:
            self._on_error(error.key, cause)
