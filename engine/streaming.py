"""Bridges one sequence on the engine thread to an asyncio consumer, with cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.sched.job import Event
from engine.types import GenerateResult, TokenDelta


class Generation:
    """Events of one generation: TokenDeltas, then the GenerateResult (or an exception).

    Create and iterate it on one event loop; `deliver` may be called from any thread.
    `cancel()` (or leaving the loop early) frees the sequence's KV blocks at the next step.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._on_cancel: Callable[[], None] = lambda: None
        self._cancelled = False
        # The queue estimate's wait before its prefill, taken as it was queued (Engine.start).
        self.queue_estimate_s = 0.0

    def bind(self, on_cancel: Callable[[], None]) -> None:
        self._on_cancel = on_cancel

    def deliver(self, event: Event) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._on_cancel()

    async def __aiter__(self) -> AsyncIterator[TokenDelta | GenerateResult]:
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
