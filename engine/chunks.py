"""Chunk KV precompute and write-back: each chunk's standalone KV computed on the worker thread as
bounded background work, in pieces between engine steps, and put in the store unless it is there
already (looked up on the caller's thread, Redis asked once for all)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from concurrent.futures import Future

from engine.blend.budget import StepBudget
from engine.blend.dense import Pausable
from engine.blend.layout import PromptBuilder, SaltedChunk
from engine.blend.prefill import Prefiller
from engine.errors import ChunkTooLongError
from engine.sched.worker import Worker
from engine.types import Chunk, ChunkWrite, PrecomputeResult
from kvstore.store import KVStore

# A chunk's outcome: a skip known at once, or its compute queued.
_Write = ChunkWrite | Future[ChunkWrite]


class ChunkPrecompute:
    """Precomputes chunks for one engine; a chunk may use at most `max_chunk_tokens` (a prompt's
    frame and one generated token must fit beside it in `max_model_len` positions)."""

    def __init__(
        self,
        prompts: PromptBuilder,
        prefiller: Prefiller,
        store: KVStore,
        worker: Worker,
        max_model_len: int,
    ):
        self.prompts = prompts
        self.prefiller = prefiller
        self.store = store
        self.worker = worker
        self.max_model_len = max_model_len
        frame = prompts.build("?", []).num_tokens
        self.max_chunk_tokens = max(0, max_model_len - frame - 1)

    def precompute(self, chunks: Iterable[Chunk | str]) -> PrecomputeResult:
        """Compute and store the standalone KV of every chunk not already in the store; waits
        until each entry is written to the store's last tier. Raises ChunkTooLongError, before
        any compute, for a chunk longer than `max_chunk_tokens`, and BackgroundQueueFullError
        when the background queue has no room for every missing chunk (none is queued)."""
        writes = self._submit(self._missing(self.tokens(chunks)))
        done = [w if isinstance(w, ChunkWrite) else w.result() for w in writes]
        return _tally(done, [d.written.result() for d in done if d.written is not None])

    async def aprecompute(self, chunks: Iterable[Chunk | str]) -> PrecomputeResult:
        """Precompute chunk by chunk as background work, between engine steps; tokenizing (and
        the length check) runs on a thread of its own, off the event loop and the model."""
        missing = await asyncio.to_thread(lambda: self._missing(self.tokens(chunks)))
        writes = self._submit(missing)
        done = await asyncio.gather(
            *(_done(w) if isinstance(w, ChunkWrite) else asyncio.wrap_future(w) for w in writes)
        )
        written = await asyncio.gather(
            *(asyncio.wrap_future(d.written) for d in done if d.written is not None)
        )
        return _tally(done, written)

    def tokens(self, chunks: Iterable[Chunk | str]) -> list[SaltedChunk]:
        """The tokens of each chunk, with its cache salt; ChunkTooLongError names the first one
        longer than `max_chunk_tokens` (its KV could never be used)."""
        result = []
        for index, chunk in enumerate(chunks):
            if isinstance(chunk, Chunk):
                name, text, salt = chunk.id, chunk.text, chunk.cache_salt
            else:
                name, text, salt = str(index), chunk, ""
            tokens = self.prompts.chunk_tokens(text)
            if len(tokens) > self.max_chunk_tokens:
                raise ChunkTooLongError(
                    f"chunk {name!r} has {len(tokens)} tokens: more than the "
                    f"{self.max_chunk_tokens} a chunk may use in a prompt of max_model_len "
                    f"{self.max_model_len} positions"
                )
            result.append((tokens, salt))
        return result

    def write_back(self, missing: list[SaltedChunk]) -> None:
        """Queue the KV of chunks a prefill found missing (in every tier) as background work;
        one that finds the queue full is dropped (the next prompt that misses it asks again)."""
        for chunk in missing:
            self.worker.offer(functools.partial(self._compute, chunk))

    def _missing(self, chunks: list[SaltedChunk]) -> list[SaltedChunk | None]:
        """Each chunk, or None where the store has its KV already."""
        found = self.store.lookup([self.prefiller.chunk_key(*chunk) for chunk in chunks])
        return [chunk if tier is None else None for chunk, tier in zip(chunks, found, strict=True)]

    def _submit(self, chunks: list[SaltedChunk | None]) -> list[_Write]:
        """A skip for each chunk the store has, the others' computes queued as background work,
        all or none (BackgroundQueueFullError)."""
        missing = [chunk for chunk in chunks if chunk is not None]
        futures = iter(
            self.worker.submit_all([functools.partial(self._compute, c) for c in missing])
        )
        return [ChunkWrite(skipped=True) if c is None else next(futures) for c in chunks]

    def _compute(self, chunk: SaltedChunk, budget: StepBudget) -> Pausable[ChunkWrite]:
        """Compute a chunk's KV (on the worker thread, in pieces within `budget`) and put it in
        the store under its salted key, unless a task queued before put it in a local tier
        meanwhile (no Redis asked here)."""
        tokens, salt = chunk
        key = self.prefiller.chunk_key(tokens, salt)
        if self.store.lookup([key], remote=False)[0] is not None:
            return ChunkWrite(skipped=True)
        kv = yield from self.prefiller.chunk_kv_steps(tokens, budget)
        return ChunkWrite(skipped=False, nbytes=kv.nbytes, written=self.store.put(key, kv))


async def _done(write: ChunkWrite) -> ChunkWrite:
    return write


def _tally(done: list[ChunkWrite], written: list[bool]) -> PrecomputeResult:
    """`written`: the write outcome of each chunk of `done` that was not skipped, in order."""
    computed = [d for d in done if not d.skipped]
    return PrecomputeResult(
        stored=sum(written),
        skipped=len(done) - len(computed),
        failed=len(written) - sum(written),
        bytes=sum(d.nbytes for d in computed),
    )
