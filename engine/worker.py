"""The engine's one model thread: engine steps while sequences wait or run, background work
(precompute, KV write-back) between steps when idle or once it has waited too long, and idle
work (shadow checks) when there is nothing else to do, plus one piece every N steps."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

# A background task that has waited this long runs between two steps even under load.
BACKGROUND_MAX_WAIT_S = 2.0


class Worker:
    """Calls `step()` while `has_work()`; runs submitted background callables FIFO in between;
    with neither, calls `idle()` (one short piece of work; False: none left) until it says so.
    With `idle_every_steps` N > 0, `idle()` also runs once after every N steps under load, so
    that idle work keeps a share of a busy engine.

    `step`, `has_work` and `idle` run on the worker thread only; `wake()` tells it that new
    work came.
    """

    def __init__(
        self,
        step: Callable[[], None],
        has_work: Callable[[], bool],
        name: str = "ragblend-engine",
        idle: Callable[[], bool] = lambda: False,
        idle_every_steps: int = 0,
    ):
        if idle_every_steps < 0:
            raise ValueError(f"idle_every_steps must be >= 0, got {idle_every_steps}")
        self._step = step
        self._has_work = has_work
        self._idle = idle
        self._idle_every_steps = idle_every_steps
        self._steps_since_idle = 0
        self._background: collections.deque[tuple[float, Callable[[], None]]] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting_background(self) -> int:
        return len(self._background)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue `fn` as background work; its Future gets the result or the exception."""
        future: Future = Future()
        # The worker runs `fn` in the caller's context: its log lines keep the request id.
        context = contextvars.copy_context()

        def task() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(context.run(fn))
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)

        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is closed")
            self._background.append((time.monotonic(), task))
            self._cond.notify()
        return future

    async def run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.submit(fn))

    def drain(self) -> None:
        """Block until the background work queued so far has run."""
        self.submit(lambda: None).result()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def _next_background(self, busy: bool) -> Callable[[], None] | None:
        with self._cond:
            if not self._background:
                return None
            queued_at, task = self._background[0]
            if busy and time.monotonic() - queued_at < BACKGROUND_MAX_WAIT_S:
                return None
            self._background.popleft()
            return task

    def _run_idle(self) -> bool:
        try:
            return self._idle()
        except Exception:  # idle work is optional: its failure must not stop the engine
            log.exception("idle work failed")
            return False

    def _loop(self) -> None:
        while True:
            busy = self._has_work()
            if busy:
                try:
                    self._step()
                except Exception:  # a step reports its own failures to its sequences
                    log.exception("engine step failed")
                self._steps_since_idle += 1
            task = self._next_background(busy)
            if task is not None:
                task()
                continue
            if busy:
                if self._idle_every_steps and self._steps_since_idle >= self._idle_every_steps:
                    self._steps_since_idle = 0
                    self._run_idle()
                continue
            if not self._closing and self._run_idle():
                continue
            with self._cond:
                if self._closing and not self._background:
                    return
                if not self._background and not self._has_work():
                    self._cond.wait(timeout=1.0)
