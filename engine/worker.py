"""The engine's single model thread: generations first, background work (precompute, KV
write-back) between them, one chunk at a time, and a bounded wait line."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any

log = logging.getLogger(__name__)


class Priority(IntEnum):
    GENERATE = 0
    BACKGROUND = 1


class QueueFullError(RuntimeError):
    """More generations wait than the configured depth; retry later."""


class Worker:
    """Runs submitted callables on one thread, lowest priority value first, FIFO within one."""

    def __init__(self, max_waiting: int = 64, name: str = "ragblend-engine"):
        self.max_waiting = max_waiting
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._waiting = {Priority.GENERATE: 0, Priority.BACKGROUND: 0}
        self._running: Priority | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting_generations(self) -> int:
        return self._waiting[Priority.GENERATE]

    @property
    def waiting_background(self) -> int:
        return self._waiting[Priority.BACKGROUND]

    @property
    def running(self) -> Priority | None:
        return self._running

    def submit(self, fn: Callable[[], Any], priority: Priority = Priority.GENERATE) -> Future:
        """Queue `fn`; raises QueueFullError when `max_waiting` generations already wait."""
        future: Future = Future()
        with self._lock:
            if priority is Priority.GENERATE and self._waiting[priority] >= self.max_waiting:
                raise QueueFullError(f"{self._waiting[priority]} generations are already waiting")
            self._waiting[priority] += 1
        # The worker runs `fn` in the caller's context: its log lines keep the request id.
        context = contextvars.copy_context()
        self._queue.put((priority, next(self._order), functools.partial(context.run, fn), future))
        return future

    async def run(self, fn: Callable[[], Any], priority: Priority = Priority.GENERATE) -> Any:
        return await asyncio.wrap_future(self.submit(fn, priority))

    def drain(self) -> None:
        """Block until everything queued so far has run."""
        self.submit(lambda: None, Priority.BACKGROUND).result()

    def close(self) -> None:
        self._queue.put((Priority.BACKGROUND + 1, next(self._order), None, None))
        self._thread.join()

    def _loop(self) -> None:
        while True:
            priority, _, fn, future = self._queue.get()
            if fn is None:
                return
            with self._lock:
                self._waiting[priority] -= 1
            if not future.set_running_or_notify_cancel():
                continue
            self._running = priority
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            finally:
                self._running = None
