"""Bridges one generation on the worker thread to an asyncio consumer, with cancellation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from engine.types import GenerateResult, TokenDelta
from engine.worker import Priority, Worker

Event = TokenDelta | GenerateResult


class Generation:
    """Events of one generation, queued to the worker at creation (QueueFullError when full).

    Iterate it from the event loop that created it; `cancel()` (or leaving the loop early)
    stops the worker at the next token.
    """

    def __init__(self, worker: Worker, events: Callable[[Callable[[], bool]], Iterator[Event]]):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._produce = events
        self.future = worker.submit(self._work, Priority.GENERATE)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _deliver(self, item) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _work(self) -> None:
        try:
            for event in self._produce(self._cancelled.is_set):
                self._deliver(event)
        except BaseException as exc:  # raised again on the consumer's side
            self._deliver(exc)

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, GenerateResult):
                    return
        finally:
            self.cancel()
