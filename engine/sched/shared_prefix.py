"""Exact prompt prefixes (template start and system prompt) held once in the KV pool: each entry
holds references to a prefix's full blocks, which every sequence starting with it shares."""

from __future__ import annotations

from collections import OrderedDict

from engine.sched.blocks import BlockManager

# A shared prefix: its cache salt and its tokens.
PrefixEntry = tuple[str, tuple[int, ...]]


class SharedPrefixes:
    """At most `capacity` prefixes (0: none shared), least recently used given back first (an
    idle one before any that running sequences share). An
    entry is a pseudo-sequence of the BlockManager holding the prefix's full blocks only: a
    partial last block would need a copy on write at the first sharer's next position."""

    def __init__(self, blocks: BlockManager, capacity: int):
        self.blocks = blocks
        self.capacity = capacity
        # (cache salt, prefix) -> its blocks: a prefix is shared only by sequences of the salt
        # it was cached under (a tenant's), so no tenant's first token tells it another's prompt.
        self._entries: OrderedDict[PrefixEntry, int] = OrderedDict()
        # Blocks the entries hold (some also held by running sequences).
        self.num_blocks = 0

    def shared_blocks(self, prefix: tuple[int, ...], salt: str = "") -> int:
        """Blocks a sequence starting with `prefix` would share now (0: not registered)."""
        return self._entries.get((salt, prefix), 0)

    def idle(self) -> OrderedDict[PrefixEntry, int]:
        """The entries no sequence shares, least recently used first, with their blocks: what
        `reclaim` may give back."""
        return OrderedDict((p, n) for p, n in self._entries.items() if self._idle(p))

    def num_idle_blocks(self) -> int:
        """Blocks only the idle entries hold: free as soon as `reclaim` gives them back."""
        return sum(self.idle().values())

    def register(self, seq_id: int, prefix: tuple[int, ...], salt: str = "") -> None:
        """Share the full blocks of `prefix` that sequence `seq_id` holds (its KV is cached), if
        that prefix is not registered yet and fills at least one block; no KV is copied."""
        num_blocks = len(prefix) // self.blocks.block_size
        entry = (salt, prefix)
        if self.capacity <= 0 or num_blocks == 0 or entry in self._entries:
            return
        self.blocks.fork(seq_id, _key(entry), num_blocks * self.blocks.block_size)
        self._entries[entry] = num_blocks
        self.num_blocks += num_blocks
        while len(self._entries) > self.capacity:
            # An idle entry first: dropping one that running sequences share frees nothing now
            # and makes their prefix's next arrivals prefill it again.
            self._drop(next(iter(self.idle()), next(iter(self._entries))))

    def allocate(
        self, seq_id: int, prefix: tuple[int, ...], num_tokens: int, salt: str = ""
    ) -> int:
        """Blocks for a new sequence of `num_tokens` positions, its first ones shared with the
        registered `prefix` of its `salt` (if any); the positions shared."""
        entry = (salt, prefix)
        if entry not in self._entries:
            self.blocks.allocate(seq_id, num_tokens)
            return 0
        self._entries.move_to_end(entry)
        shared = self.blocks.num_tokens(_key(entry))
        self.blocks.fork(_key(entry), seq_id)
        self.blocks.append_slots(seq_id, num_tokens - shared)  # full blocks: nothing to copy
        return shared

    def reclaim(self, num_free: int, keep: tuple[int, ...] = (), salt: str = "") -> None:
        """Give back idle entries (not `keep` of `salt`), least recently used first, until
        `num_free` blocks are free or none is left."""
        for entry in self.idle():
            if self.blocks.num_free_blocks >= num_free:
                return
            if entry != (salt, keep):
                self._drop(entry)

    def _idle(self, entry: PrefixEntry) -> bool:
        return all(self.blocks.refcount(b) == 1 for b in self.blocks.block_table(_key(entry)))

    def _drop(self, entry: PrefixEntry) -> None:
        self.blocks.free(_key(entry))
        self.num_blocks -= self._entries.pop(entry)


def _key(entry: PrefixEntry) -> tuple[str, PrefixEntry]:
    """The entry's id in the BlockManager, apart from every sequence's int id."""
    return ("prefix", entry)
