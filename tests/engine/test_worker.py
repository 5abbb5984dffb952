"""The engine's model thread: generations before background work, bounded waiting."""

from __future__ import annotations

import threading
import time

import pytest

from engine.worker import Priority, QueueFullError, Worker


def test_a_waiting_generation_runs_before_queued_background_work():
    worker = Worker(max_waiting=4)
    order: list[str] = []
    gate = threading.Event()
    worker.submit(gate.wait, Priority.BACKGROUND)  # occupies the thread: one chunk's compute
    for i in range(3):
        worker.submit(lambda i=i: order.append(f"chunk{i}"), Priority.BACKGROUND)
    generation = worker.submit(lambda: order.append("generate"), Priority.GENERATE)
    gate.set()
    generation.result(timeout=5)
    worker.drain()
    assert order == ["generate", "chunk0", "chunk1", "chunk2"]
    worker.close()


def test_more_waiting_generations_than_the_depth_are_refused():
    worker = Worker(max_waiting=2)
    gate = threading.Event()
    worker.submit(gate.wait)
    while worker.running is not Priority.GENERATE:
        time.sleep(0.001)
    waiting = [worker.submit(lambda: None) for _ in range(2)]
    assert worker.waiting_generations == 2
    with pytest.raises(QueueFullError, match="2 generations are already waiting"):
        worker.submit(lambda: None)
    worker.submit(lambda: None, Priority.BACKGROUND)  # background work is not limited
    gate.set()
    for future in waiting:
        future.result(timeout=5)
    worker.close()


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    worker = Worker()

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        worker.submit(fail).result(timeout=5)
    assert worker.submit(lambda: 7).result(timeout=5) == 7
    worker.close()
