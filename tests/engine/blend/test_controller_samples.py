"""What the controller learns from served prefills: the compute time of layers that ran alone
only, so that prefills side by side (whose layers also timed each other's work) leave its
estimate, and its choices on a slow tier, exactly as one prefill alone left them."""

from __future__ import annotations

import threading
import time

import pytest

from engine.engine import Engine
from engine.model.load import load_model
from engine.types import GenerateRequest, StepRecord
from kvstore import tiers
from kvstore.store import KVStore, KVStoreConfig

SIDE_BY_SIDE = 8


@pytest.fixture
def engine(checkpoint_dir):
    loaded = load_model(checkpoint_dir("llama"))
    store = KVStore(KVStoreConfig(model_fingerprint=loaded.fingerprint, stage_kv=True))
    engine = Engine(loaded, store, max_num_seqs=SIDE_BY_SIDE)
    yield engine
    engine.close()
    store.close()


def _hold_worker(engine: Engine) -> threading.Event:
    """Block the engine's worker thread in a background task until the returned event is set:
    requests queue meanwhile, and its next step admits them together."""
    started, release = threading.Event(), threading.Event()
    engine.worker.submit(lambda: (started.set(), release.wait(30)))
    assert started.wait(10)
    return release


def test_prefills_side_by_side_leave_the_compute_estimate_as_one_alone_left_it(engine, make_chunks):
    chunks = make_chunks(3, seed=5)
    engine.precompute(chunks)
    records: list[StepRecord] = []
    engine.add_step_listener(records.append)
    engine.generate(GenerateRequest(question="who holds kalo?", chunks=chunks, max_tokens=2))
    controller = engine.prefiller.controller
    alone = controller.token_layer_s
    assert alone is not None, "a lone prefill's layers teach the controller"
    slow_tier = {tiers.SSD: 10**7}  # bytes per layer read at the SSD's prior speed
    choice = controller.estimate(400, slow_tier)

    release = _hold_worker(engine)
    questions = [f"what does vo number {j} hold?" for j in range(SIDE_BY_SIDE)]
    threads = [
        threading.Thread(
            target=engine.generate,
            args=(GenerateRequest(question=q, chunks=chunks, max_tokens=2),),
        )
        for q in questions
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while engine.num_waiting < SIDE_BY_SIDE and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for thread in threads:
        thread.join(timeout=60)

    assert max(r.num_prefills for r in records) == SIDE_BY_SIDE  # one step ran them all
    assert controller.token_layer_s == alone
    assert controller.estimate(400, slow_tier) == choice
