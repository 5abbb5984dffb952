"""A failure while completing one sequence fails that sequence only: its first token (the prefill
completing) or a later one (a decode fused into a prefill's forward) raising in its consumer's
hand-off ends it with an error, while the sequences beside it get the tokens they get alone and
the engine serves on."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from engine.engine import Engine
from engine.sched.job import Event
from engine.sched.scheduler import MIN_PREFILL_TOKENS
from engine.types import GenerateRequest, GenerateResult, Mode, TokenDelta

pytestmark = pytest.mark.timeout(120)  # a sequence failing every step would hang: a failure


class ConsumerError(RuntimeError):
    """What the failing consumer raises."""


def request(chunks, **overrides) -> GenerateRequest:
    values = {"question": "which tas does kalo hold?", "chunks": chunks, "max_tokens": 8}
    return GenerateRequest(**{**values, **overrides})


class Consumer:
    """A request's events; with `fail_at` N it raises as it is handed its Nth token."""

    def __init__(self, fail_at: int | None = None):
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.fail_at, self.tokens = fail_at, 0

    def emit(self, event: Event) -> None:
        if isinstance(event, TokenDelta):
            self.tokens += 1
            if self.tokens == self.fail_at:
                raise ConsumerError(f"the consumer failed at token {self.tokens}")
        self.events.put(event)

    def outcome(self) -> GenerateResult | BaseException:
        while True:
            event = self.events.get(timeout=60)
            if isinstance(event, GenerateResult | BaseException):
                return event


def settled(engine: Engine) -> bool:
    """Whether the engine finished every sequence (a result reaches its consumer before the
    step that produced it has freed its sequence)."""
    deadline = time.monotonic() + 10
    while engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    return not engine.scheduler.has_work


def serve(engine: Engine, first: tuple, later: list[tuple]) -> list:
    """`first` (a request and its consumer) starts alone; once its first token is out, `later`
    arrive together. Every request's outcome, in that order."""
    req, consumer = first
    engine._submit(req, None, consumer.emit)
    while consumer.tokens == 0:
        threading.Event().wait(0.005)
    for r, c in later:
        engine._submit(r, None, c.emit)
    return [c.outcome() for _, c in [first, *later]]


@pytest.fixture
def engine(checkpoint_dir):
    engine = Engine.from_pretrained(
        checkpoint_dir("llama"), check_layers=(1,), max_num_batched_tokens=2 * MIN_PREFILL_TOKENS
    )
    yield engine
    engine.close()


def test_a_sequence_failing_as_its_prefill_completes_fails_alone(engine, make_chunks):
    chunks = make_chunks(5, words=40, seed=71)
    engine.precompute(chunks)
    first = request(chunks[:1], mode=Mode.FULL_PREFILL, max_tokens=40, ignore_eos=True)
    failing, beside = request(chunks[1:3]), request(chunks[3:], mode=Mode.FULL_PREFILL)
    alone = [engine.generate(r).token_ids for r in (first, beside)]
    outcomes = serve(
        engine, (first, Consumer()), [(failing, Consumer(fail_at=1)), (beside, Consumer())]
    )
    assert isinstance(outcomes[1], ConsumerError)
    assert [outcomes[0].token_ids, outcomes[2].token_ids] == alone
    assert engine.generate(beside).token_ids == alone[1]  # the engine serves on
    assert settled(engine)


def test_a_sequence_failing_in_a_decode_beside_a_prefill_fails_alone(engine, make_chunks):
    chunks = make_chunks(5, words=40, seed=72)
    engine.precompute(chunks)
    failing = request(chunks[:1], mode=Mode.FULL_PREFILL, max_tokens=40, ignore_eos=True)
    beside = request(chunks[1:], mode=Mode.FULL_PREFILL)  # prefilled in pieces beside it
    alone = engine.generate(beside).token_ids
    # Its third token comes from a decode whose rows are fused into the other's prefill.
    outcomes = serve(engine, (failing, Consumer(fail_at=3)), [(beside, Consumer())])
    assert isinstance(outcomes[0], ConsumerError)
    assert outcomes[1].token_ids == alone
    assert settled(engine)
