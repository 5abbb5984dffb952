"""The engine's model thread: steps while there is work, background work between them."""

from __future__ import annotations

import threading
import time

import pytest

from engine.sched.worker import Worker


class Steps:
    """A fake step source: `pending` steps to run, each appending to a shared log."""

    def __init__(self, log: list[str]):
        self.log = log
        self.pending = 0

    def step(self) -> float:
        self.pending -= 1
        self.log.append("step")
        time.sleep(0.005)
        return 16.0


def test_a_background_callable_runs_whole_after_the_next_step():
    log: list[str] = []
    steps = Steps(log)
    steps.pending = 5  # set before the worker starts: its first turn is a step
    worker = Worker(steps.step, lambda: steps.pending > 0)
    worker.submit(lambda: log.append("background")).result(timeout=5)
    while steps.pending > 0:
        time.sleep(0.001)
    worker.close()
    assert log == ["step", "background"] + ["step"] * 4


def test_under_load_the_head_background_task_runs_one_piece_after_each_step():
    log: list[str] = []
    steps = Steps(log)
    steps.pending = 1000
    worker = Worker(steps.step, lambda: steps.pending > 0)

    def three_pieces(budget):
        for piece in range(3):
            log.append(f"piece {piece}")
            if piece < 2:
                budget.spend(budget.left)  # this piece spent what the step left it
                yield None

    future = worker.background.submit_all([three_pieces])[0]
    future.result(timeout=5)
    assert steps.pending > 0  # it ran while steps were still due
    steps.pending = 0
    worker.close()
    first = log.index("piece 0")
    assert log[first - 1 : first + 5] == ["step", "piece 0", "step", "piece 1", "step", "piece 2"]


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    worker = Worker(lambda: 0.0, lambda: False)

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        worker.submit(fail).result(timeout=5)
    assert worker.submit(lambda: 7).result(timeout=5) == 7
    worker.close()


def test_wake_starts_a_step_at_once():
    started = threading.Event()
    work = [False]

    def step() -> float:
        work[0] = False
        started.set()
        return 16.0

    worker = Worker(step, lambda: work[0])
    time.sleep(0.05)  # the worker is idle and waiting
    work[0] = True
    worker.wake()
    assert started.wait(0.5)
    worker.close()


def test_idle_work_runs_when_nothing_else_is_due_and_never_between_due_steps():
    log: list[str] = []
    steps = Steps(log)
    idle_calls = threading.Semaphore(0)

    def idle() -> bool:  # endless idle work, one short piece per call
        log.append("idle")
        idle_calls.release()
        time.sleep(0.001)
        return True

    worker = Worker(steps.step, lambda: steps.pending > 0, idle=idle)
    assert idle_calls.acquire(timeout=5)
    steps.pending = 3
    worker.wake()
    while steps.pending > 0:
        time.sleep(0.001)
    before = log.count("idle")
    deadline = time.monotonic() + 5
    while log.count("idle") <= before and time.monotonic() < deadline:
        time.sleep(0.001)
    worker.close()
    assert log.count("idle") > before  # idle work goes on once the steps are done
    first = log.index("step")
    assert log[first : first + 3] == ["step", "step", "step"]


def test_idle_work_gets_one_turn_after_every_n_steps_under_load():
    log: list[str] = []
    steps = Steps(log)
    steps.pending = 7  # set before the worker starts: every turn until then is a step

    def idle() -> bool:
        log.append("idle")
        return True

    worker = Worker(steps.step, lambda: steps.pending > 0, idle=idle, idle_every_steps=3)
    while steps.pending > 0:
        time.sleep(0.001)
    worker.close()
    # Seven steps with a turn of idle work after the third and the sixth; then idle freely.
    assert log[:9] == ["step"] * 3 + ["idle"] + ["step"] * 3 + ["idle", "step"]


def test_a_negative_idle_share_is_refused():
    with pytest.raises(ValueError, match="idle_every_steps"):
        Worker(lambda: 0.0, lambda: False, idle_every_steps=-1)
