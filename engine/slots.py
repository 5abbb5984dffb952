"""Which KV-pool slot each running sequence owns: plain bookkeeping on ints, no tensors.

The pool is cut into equal slots of `slot_tokens` (the longest prompt plus completion the
engine serves); the lowest free slot is handed out first, so the slots in use stay packed
at the bottom and a batched decode attends over slots up to the highest in use only.
"""

from __future__ import annotations

import heapq


class SlotTable:
    def __init__(self, num_slots: int, slot_tokens: int):
        if num_slots < 1 or slot_tokens < 1:
            raise ValueError(f"need at least one slot of one token, got {num_slots}x{slot_tokens}")
        self.num_slots = num_slots
        self.slot_tokens = slot_tokens
        self._free = list(range(num_slots))  # a heap: the lowest slot comes out first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        """The lowest free slot; raises RuntimeError when every slot is taken."""
        if not self._free:
            raise RuntimeError("no free KV slot")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot in self._used, f"slot {slot} is not in use"
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
