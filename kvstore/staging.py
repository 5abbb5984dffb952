"""One layer of a stream's chunks as one tensor pair on the device, in a number of copies and
kernels that does not grow with the number of chunks: host tensors move in one call (pinned
ones straight to the device, the others through a pinned staging slab and one copy), compressed
chunks are dequantized together, and every chunk's tokens are joined by one cat."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch

from kvstore.codec import QuantizedPair, dequantize
from kvstore.tiers import KVPair, LayerItem
from kvstore.types import LayerKV

# Staging slabs. A slab is reused two loads later; its previous host->device copy (tens of
# GB/s) has long finished by then, and waiting on that copy's event makes it certain.
RING_SLABS = 2
# Every tensor packed into a slab starts on this boundary, so any dtype can view it.
PACK_ALIGN = 256


def packed_size(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of a slab that holds `tensors` back to back, each on a PACK_ALIGN boundary."""
    return sum(-(-t.nbytes // PACK_ALIGN) * PACK_ALIGN for t in tensors)


def slab_views(slab: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the uint8 `slab` with the dtypes and shapes of `like`, back to back, each on a
    PACK_ALIGN boundary."""
    views, offset = [], 0
    for t in like:
        views.append(slab[offset : offset + t.nbytes].view(t.dtype).view(t.shape))
        offset += -(-t.nbytes // PACK_ALIGN) * PACK_ALIGN
    return views


class StagingRing:
    """RING_SLABS staging slabs for copies to one device, used by one loader thread at a time;
    on CUDA the slabs are pinned and `copy_stream` is the stream their copies run on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._slabs: list[torch.Tensor] = []  # allocated at the first copy
        self._events: list[torch.cuda.Event | None] = [None] * RING_SLABS
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next slab's index and its first `nbytes`, once the copy that last read it is
        done; slabs grow to the largest layer seen."""
        index = self._next
        self._next = (index + 1) % RING_SLABS
        previous = self._events[index]
        if previous is not None:
            previous.synchronize()
        if not self._slabs or self._slabs[index].numel() < nbytes:
            pin = self.copy_stream is not None
            if self.copy_stream is not None:
                self.copy_stream.synchronize()  # the old slabs may still be read by a copy
            self._slabs = [
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(RING_SLABS)
            ]
            self._events = [None] * RING_SLABS
        return index, self._slabs[index][:nbytes]

    def copied(self, index: int, event: torch.cuda.Event) -> None:
        """Slab `index` is read by the copy that `event` marks the end of."""
        self._events[index] = event


class StagingRings:
    """The loader's rings, one per device a stream copies to, created at its first stream."""

    def __init__(self) -> None:
        self._rings: dict[torch.device, StagingRing] = {}
        self._lock = threading.Lock()

    def for_device(self, device: torch.device) -> StagingRing:
        with self._lock:
            ring = self._rings.get(device)
            if ring is None:
                ring = self._rings[device] = StagingRing(device)
            return ring


@dataclasses.dataclass
class Moved:
    """What moving one layer's host tensors did: the copy calls made (0 when nothing moved),
    their bytes, and the staging slab read (None: none)."""

    copies: int = 0
    nbytes: int = 0
    slab: int | None = None


def item_tensors(item: LayerItem) -> list[torch.Tensor]:
    if isinstance(item, tuple):
        return list(item)
    return [item.k, item.v, item.k_scale, item.v_scale]


def _with_tensors(item: LayerItem, tensors: list[torch.Tensor]) -> LayerItem:
    if isinstance(item, tuple):
        return tensors[0], tensors[1]
    k, v, k_scale, v_scale = tensors
    return dataclasses.replace(item, k=k, v=v, k_scale=k_scale, v_scale=v_scale)


def move_to_device(
    items: list[LayerItem], device: torch.device, ring: StagingRing
) -> tuple[list[LayerItem], Moved]:
    """`items` with every host tensor on `device` (on the CPU: copied anyway, as a GPU's path
    does), in at most two copy calls: pinned tensors straight into a device slab, the others
    packed into a staging slab first (host copies in one call, which releases the GIL) and
    copied to the device in one piece. Runs on the ring's copy stream where it has one."""
    tensors = [t for item in items for t in item_tensors(item)]
    moves = [t.device != device or device.type == "cpu" for t in tensors]
    if not any(moves):
        return items, Moved()
    cuda = device.type == "cuda"
    direct = [cuda and moving and t.is_pinned() for t, moving in zip(tensors, moves, strict=True)]
    staged = [moving and not pin for moving, pin in zip(moves, direct, strict=True)]
    landed: dict[int, torch.Tensor] = {}  # position in `tensors` -> its copy on the device
    moved = Moved()
    if any(direct):
        sources = [t for t, pick in zip(tensors, direct, strict=True) if pick]
        slab = torch.empty(packed_size(sources), dtype=torch.uint8, device=device)
        targets = slab_views(slab, sources)
        torch._foreach_copy_(targets, sources, non_blocking=True)
        landed.update(zip([j for j, pick in enumerate(direct) if pick], targets, strict=True))
        moved.copies, moved.nbytes = moved.copies + 1, moved.nbytes + slab.nbytes
    if any(staged):
        sources = [t for t, pick in zip(tensors, staged, strict=True) if pick]
        moved.slab, staging = ring.take(packed_size(sources))
        torch._foreach_copy_(slab_views(staging, sources), sources)
        slab = staging.to(device, non_blocking=True, copy=True)
        targets = slab_views(slab, sources)
        landed.update(zip([j for j, pick in enumerate(staged) if pick], targets, strict=True))
        moved.copies, moved.nbytes = moved.copies + 1, moved.nbytes + slab.nbytes
    rebuilt, position = [], 0
    for item in items:
        parts = item_tensors(item)
        rebuilt.append(
            _with_tensors(item, [landed.get(position + j, t) for j, t in enumerate(parts)])
        )
        position += len(parts)
    return rebuilt, moved


def join(items: list[LayerItem], chunk_index: Callable[[tuple[int, ...]], torch.Tensor]) -> LayerKV:
    """One LayerKV of `items` (each on the device, in request order): a single plain chunk as
    itself (no copy), else the compressed chunks of each storage dtype dequantized together,
    then every chunk's tokens joined by one cat per K and V. `chunk_index(lengths)`: for chunks
    of those lengths, each token's chunk index on the device (`chunk_of_each_token`)."""
    lengths = tuple(_num_tokens(item) for item in items)
    if len(items) == 1 and isinstance(items[0], tuple):
        return LayerKV(items[0][0], items[0][1], lengths)
    pairs: list[KVPair | None] = [item if isinstance(item, tuple) else None for item in items]
    for group in _by_storage_dtype(items):
        group_lengths = tuple(lengths[j] for j in group)
        quantized = [items[j] for j in group]
        keys, values = _dequantize_together(quantized, chunk_index(group_lengths))  # type: ignore[arg-type]
        if len(group) == len(items):
            return LayerKV(keys, values, lengths)
        for j, pair in zip(group, LayerKV(keys, values, group_lengths), strict=True):
            pairs[j] = pair
    joined = [pair for pair in pairs if pair is not None]
    return LayerKV(
        torch.cat([k for k, _ in joined], dim=1), torch.cat([v for _, v in joined], dim=1), lengths
    )


def _num_tokens(item: LayerItem) -> int:
    return int((item[0] if isinstance(item, tuple) else item.k).shape[1])


def _by_storage_dtype(items: list[LayerItem]) -> list[list[int]]:
    """Indices of the compressed items, grouped by payload dtype (an entry of another encoding,
    written before a restart, may sit beside the current one's)."""
    groups: dict[torch.dtype, list[int]] = {}
    for j, item in enumerate(items):
        if isinstance(item, QuantizedPair):
            groups.setdefault(item.k.dtype, []).append(j)
    return list(groups.values())


def _dequantize_together(quantized: list[QuantizedPair], token_chunks: torch.Tensor) -> KVPair:
    """K and V [H_kv, Nq, D] of compressed chunks of one storage dtype: payloads joined, each
    token's scales picked by its chunk's index, one dequantization for all."""
    if len(quantized) == 1:
        return quantized[0].dequantize()
    dtype = quantized[0].dtype
    k = torch.cat([q.k for q in quantized], dim=1)
    v = torch.cat([q.v for q in quantized], dim=1)
    k_scale = torch.cat([q.k_scale for q in quantized], dim=1).index_select(1, token_chunks)
    v_scale = torch.cat([q.v_scale for q in quantized], dim=1).index_select(1, token_chunks)
    return dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype)


def chunk_of_each_token(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """[sum(lengths)] on `device`: for each token of chunks of `lengths`, its chunk's index;
    copied from pinned memory without a sync on CUDA."""
    index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)
