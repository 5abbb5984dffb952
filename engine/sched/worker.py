"""The engine's one model thread: engine steps while sequences wait or run, each followed by a
piece of background work (precompute, KV write-back) within the tokens the step left it; that
work whole when idle, and idle work (shadow checks) when there is nothing else to do."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from engine.sched.background import BackgroundQueue, Start, once

log = logging.getLogger(__name__)

# A step that failed leaves background work this many tokens (the prefills' floor).
FAILED_STEP_TOKENS = 16


class Worker:
    """Calls `step()` while `has_work()`: it returns the tokens its step left background work
    (math.inf: no bound), and the head of `background` runs one piece within them. Without
    steps due, background tasks run whole, one after another; with neither, `idle()` (one short
    piece of work; False: none left) until it says so. With `idle_every_steps` N > 0, `idle()`
    also runs once after every N steps under load, so that idle work keeps a share of a busy
    engine.

    `step`, `has_work` and `idle` run on the worker thread only; `wake()` tells it that new
    work came.
    """

    def __init__(
        self,
        step: Callable[[], float],
        has_work: Callable[[], bool],
        name: str = "ragblend-engine",
        idle: Callable[[], bool] = lambda: False,
        idle_every_steps: int = 0,
        background: BackgroundQueue | None = None,
    ):
        if idle_every_steps < 0:
            raise ValueError(f"idle_every_steps must be >= 0, got {idle_every_steps}")
        self._step = step
        self._has_work = has_work
        self._idle = idle
        self._idle_every_steps = idle_every_steps
        self._steps_since_idle = 0
        self.background = background if background is not None else BackgroundQueue(1 << 16)
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting_background(self) -> int:
        return len(self.background)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` whole on the worker thread as background work, outside the queue's bound;
        its Future gets the result or the exception."""
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is closed")
            future = self.background.submit_unbounded(once(fn))
            self._cond.notify()
        return future

    def submit_all(self, starts: list[Start]) -> list[Future]:
        """Queue bounded background tasks, all or none (BackgroundQueue.submit_all)."""
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is closed")
            futures = self.background.submit_all(starts)
            self._cond.notify()
        return futures

    def offer(self, start: Start) -> None:
        """Queue a bounded task when there is room, else drop it (counted); nothing once
        closing: a task queued then would never run."""
        with self._cond:
            if not self._closing and self.background.offer(start) is not None:
                self._cond.notify()

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

    def _run_idle(self) -> bool:
        try:
            return self._idle()
        except Exception:  # idle work is optional: its failure must not stop the engine
            log.exception("idle work failed")
            return False

    def _loop(self) -> None:
        while True:
            if self._has_work():
                try:
                    tokens = self._step()
                except Exception:  # a step reports its own failures to its sequences
                    log.exception("engine step failed")
                    tokens = FAILED_STEP_TOKENS
                self.background.run_piece(tokens)
                self._steps_since_idle += 1
                if self._idle_every_steps and self._steps_since_idle >= self._idle_every_steps:
                    self._steps_since_idle = 0
                    self._run_idle()
                continue
            if self.background.run_piece(math.inf):
                continue
            if not self._closing and self._run_idle():
                continue
            with self._cond:
                if self._closing and not len(self.background):
                    return
                if not len(self.background) and not self._has_work():
                    self._cond.wait(timeout=1.0)
