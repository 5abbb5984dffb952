"""The loader's staging ring: a layer's host tensors packed into one slot (pinned on CUDA) and
copied to the device in one piece, on a copy stream that the loader owns for every stream."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

# Staging slots. A slot is reused two loads later; its previous host->device copy (tens of
# GB/s) has long finished by then, and waiting on that copy's event makes it certain.
RING_SLOTS = 2
# Every tensor packed into a staging slab starts on this boundary, so any dtype can view it.
PACK_ALIGN = 256


def packed_size(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of a slab that holds `tensors` back to back, each on a PACK_ALIGN boundary."""
    return sum(-(-t.nbytes // PACK_ALIGN) * PACK_ALIGN for t in tensors)


def pack(tensors: Sequence[torch.Tensor], slab: torch.Tensor) -> list[int]:
    """Copy `tensors` into the uint8 `slab` back to back; returns each one's byte offset."""
    offsets, offset = [], 0
    for t in tensors:
        slab[offset : offset + t.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        offsets.append(offset)
        offset += -(-t.nbytes // PACK_ALIGN) * PACK_ALIGN
    return offsets


def unpack(
    slab: torch.Tensor, offsets: Sequence[int], like: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Views of `slab` with the dtypes and shapes of `like`, at `offsets` (see pack)."""
    return [
        slab[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        for offset, t in zip(offsets, like, strict=True)
    ]


class StagingRing:
    """RING_SLOTS staging slots for copies to one device, used by one loader thread at a time;
    on CUDA the slots are pinned and `copy_stream` is the stream their copies run on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._slots: list[torch.Tensor] = []  # allocated at the first copy
        self._events: list[torch.cuda.Event | None] = [None] * RING_SLOTS
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next slot's index and its first `nbytes`, once the copy that last read it is
        done; slots grow to the largest layer seen."""
        index = self._next
        self._next = (index + 1) % RING_SLOTS
        previous = self._events[index]
        if previous is not None:
            previous.synchronize()
        if not self._slots or self._slots[index].numel() < nbytes:
            pin = self.copy_stream is not None
            if self.copy_stream is not None:
                self.copy_stream.synchronize()  # the old slots may still be read by a copy
            self._slots = [
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(RING_SLOTS)
            ]
            self._events = [None] * RING_SLOTS
        return index, self._slots[index][:nbytes]

    def copied(self, index: int, event: torch.cuda.Event) -> None:
        """Slot `index` is read by the copy that `event` marks the end of."""
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
