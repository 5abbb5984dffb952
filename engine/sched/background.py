"""The engine's background work (chunk precompute, KV write-back) in a bounded FIFO queue: under
load the head task runs one piece after each step, within the tokens the step left it."""

from __future__ import annotations

import collections
import contextvars
import math
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.blend.budget import StepBudget
from engine.blend.dense import Pausable, advance
from engine.errors import BackgroundQueueFullError

# A task: given the budget it spends (token-layers, refilled before each piece), the pausable
# that does the work and returns its result.
Start = Callable[[StepBudget], Pausable[Any]]


@dataclass(eq=False)
class _Task:
    start: Start
    future: Future
    context: contextvars.Context
    bounded: bool  # counts against the queue's bound (work a caller asked for)
    budget: StepBudget | None = None
    pausable: Pausable[Any] | None = None


class BackgroundQueue:
    """At most `max_tasks` bounded tasks wait (unbounded ones, such as `drain`'s marker, do not
    count); `num_layers` turns a piece's tokens into the token-layers a StepBudget counts.
    Thread-safe: callers submit, the worker thread runs pieces."""

    def __init__(self, max_tasks: int, num_layers: int = 1):
        if max_tasks < 1:
            raise ValueError(f"max_tasks must be >= 1, got {max_tasks}")
        self.max_tasks = max_tasks
        self.num_layers = num_layers
        self.pieces = 0  # pieces run so far (a task run whole is one)
        self.dropped = 0  # tasks refused by `offer` because the queue was full
        self._tasks: collections.deque[_Task] = collections.deque()
        self._num_bounded = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tasks)

    def submit_all(self, starts: Iterable[Start]) -> list[Future]:
        """Queue every task, or none: BackgroundQueueFullError when they do not all fit."""
        starts = list(starts)
        with self._lock:
            if self._num_bounded + len(starts) > self.max_tasks:
                raise BackgroundQueueFullError(
                    f"the engine's background queue is full: {self._num_bounded} of "
                    f"{self.max_tasks} chunk computations wait, {len(starts)} more asked"
                )
            return [self._append(start, bounded=True) for start in starts]

    def offer(self, start: Start) -> Future | None:
        """Queue the task when there is room, else drop it (None, counted in `dropped`)."""
        try:
            return self.submit_all([start])[0]
        except BackgroundQueueFullError:
            with self._lock:
                self.dropped += 1
            return None

    def submit_unbounded(self, start: Start) -> Future:
        """Queue a task outside the bound (the engine's own markers and hand-offs)."""
        with self._lock:
            return self._append(start, bounded=False)

    def _append(self, start: Start, bounded: bool) -> Future:
        # The worker runs the task in the caller's context: its log lines keep the request id.
        task = _Task(start, Future(), contextvars.copy_context(), bounded)
        self._tasks.append(task)
        self._num_bounded += bounded
        return task.future

    def run_piece(self, tokens: float = math.inf) -> bool:
        """Advance the head task by at most `tokens` tokens (math.inf: to its end); its future
        gets the result or the exception once it ends. False: no task waited."""
        with self._lock:
            if not self._tasks:
                return False
            task = self._tasks[0]
        if task.pausable is None:
            if not task.future.set_running_or_notify_cancel():
                self._pop(task)
                return True
            task.budget = StepBudget()
            task.pausable = task.context.run(task.start, task.budget)
        assert task.budget is not None
        task.budget.refill(tokens * self.num_layers)
        self.pieces += 1
        try:
            done, result = task.context.run(advance, task.pausable)
        except BaseException as exc:  # handed to whoever waits on the future
            self._pop(task)
            task.future.set_exception(exc)
            return True
        if done:
            self._pop(task)
            task.future.set_result(result)
        return True

    def _pop(self, task: _Task) -> None:
        with self._lock:
            self._tasks.popleft()
            self._num_bounded -= task.bounded

    def fail_all(self, exc: BaseException) -> None:
        """Fail every task still queued (the engine closes)."""
        with self._lock:
            tasks, self._tasks, self._num_bounded = list(self._tasks), collections.deque(), 0
        for task in tasks:
            if task.pausable is not None:
                task.pausable.close()
            if not task.future.done():
                task.future.set_exception(exc)


def once(fn: Callable[[], Any]) -> Start:
    """A task that runs `fn` whole in one piece, whatever its budget."""

    def start(budget: StepBudget) -> Pausable[Any]:
        return fn()
        yield  # a generator: `fn` runs when the worker first advances it

    return start
