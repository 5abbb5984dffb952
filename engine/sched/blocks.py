"""Paged-KV bookkeeping on ints: a pool of fixed-size blocks with reference counts, and per
sequence a block table that grows one block at a time (shared blocks copied on write)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from engine.types import DEFAULT_BLOCK_SIZE


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than the allocation needs; nothing was allocated."""


@dataclass(frozen=True)
class BlockCopy:
    """Copy block `src` into `dst` before writing: `dst` replaced a shared, partly full block."""

    src: int
    dst: int


class BlockManager:
    """`num_blocks` blocks of `block_size` tokens; sequences are any hashable id."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one token, got {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # 1 where a block is free. A sequence's blocks are taken as one run of consecutive ids
        # where there is one (the lowest): the CPU decode reads a row's keys as views of its
        # runs, and each run is an attention call of its own (docs/benchmarks/serving.md,
        # "Paged KV"); past two runs it gathers (engine/model/paged_attention.py).
        self._free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._refs = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self._num_free

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def block_table(self, seq: Hashable) -> list[int]:
        return list(self._table(seq))

    def num_tokens(self, seq: Hashable) -> int:
        self._table(seq)
        return self._lengths[seq]

    def allocate(self, seq: Hashable, num_tokens: int) -> list[int]:
        """A new sequence with room for `num_tokens`; its block table."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq!r} already has blocks")
        if num_tokens < 1:
            raise ValueError(f"a sequence needs at least one token, got {num_tokens}")
        self._tables[seq] = self._take(self.blocks_for(num_tokens))
        self._lengths[seq] = num_tokens
        return self.block_table(seq)

    def fork(self, parent: Hashable, child: Hashable, num_tokens: int | None = None) -> list[int]:
        """A new sequence sharing the blocks of `parent`'s first `num_tokens` (default all)."""
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already has blocks")
        length = self.num_tokens(parent) if num_tokens is None else num_tokens
        if not 1 <= length <= self.num_tokens(parent):
            raise ValueError(f"cannot share {length} of {parent!r}'s {self.num_tokens(parent)}")
        shared = self._tables[parent][: self.blocks_for(length)]
        for block in shared:
            self._refs[block] += 1
        self._tables[child] = list(shared)
        self._lengths[child] = length
        return self.block_table(child)

    def blocks_to_append(self, seq: Hashable, num_tokens: int = 1) -> int:
        """Free blocks `append_slots(seq, num_tokens)` takes (a copy on write counts one)."""
        table, length = self._table(seq), self._lengths[seq]
        new = self.blocks_for(length + num_tokens) - len(table)
        partial = length % self.block_size != 0
        return new + (1 if partial and self._refs[table[-1]] > 1 else 0)

    def can_append(self, seq: Hashable, num_tokens: int = 1) -> bool:
        return self.blocks_to_append(seq, num_tokens) <= self._num_free

    def append_slots(self, seq: Hashable, num_tokens: int = 1) -> BlockCopy | None:
        """Room for `num_tokens` more positions. Writing into a shared, partly full last block
        gives the sequence a fresh block instead: the caller copies the returned (src, dst)."""
        need = self.blocks_to_append(seq, num_tokens)
        if need > self._num_free:
            raise NoFreeBlocksError(f"{seq!r} needs {need} blocks, {self._num_free} are free")
        table, length = self._tables[seq], self._lengths[seq]
        copy = None
        if length % self.block_size and self._refs[table[-1]] > 1:
            (fresh,) = self._take(1)
            self._refs[table[-1]] -= 1
            copy = BlockCopy(table[-1], fresh)
            table[-1] = fresh
        table += self._take(self.blocks_for(length + num_tokens) - len(table))
        self._lengths[seq] = length + num_tokens
        return copy

    def free(self, seq: Hashable) -> None:
        """Drop the sequence; its blocks no other sequence shares are free again."""
        for block in reversed(self._table(seq)):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = 1
                self._num_free += 1
        del self._tables[seq], self._lengths[seq]

    def _table(self, seq: Hashable) -> list[int]:
        try:
            return self._tables[seq]
        except KeyError:
            raise KeyError(f"sequence {seq!r} has no blocks") from None

    def _take(self, count: int) -> list[int]:
        """`count` free blocks: the lowest run of that many consecutive ids, else the lowest
        free ids."""
        if count > self._num_free:
            raise NoFreeBlocksError(f"{count} blocks needed, {self._num_free} are free")
        start = self._free.find(b"\x01" * count) if count else 0
        if start >= 0:
            taken = list(range(start, start + count))
        else:
            taken, at = [], -1
            while len(taken) < count:
                at = self._free.find(1, at + 1)
                taken.append(at)
        for block in taken:
            self._free[block] = 0
            self._refs[block] = 1
        self._num_free -= count
        return taken
