"""Schemathesis over the engine's OpenAPI spec, against a live process on a tiny model: no
5xx, and only the statuses each operation declares."""

from __future__ import annotations

import signal

from demo.tiny import save_random_checkpoint
from tests.openapi_fuzz import fuzz
from tests.service_process import start_service


def test_engine_answers_generated_requests_with_declared_statuses_and_no_5xx(tmp_path):
    save_random_checkpoint("llama", tmp_path / "model", seed=3, max_positions=256)
    service = start_service(
        "engine",
        [
            "--model",
            str(tmp_path / "model"),
            "--store-path",
            str(tmp_path / "kv"),
            # Generated requests stay cheap: a few tokens each.
            "--max-tokens-limit",
            "4",
        ],
        tmp_path / "engine.log",
    )
    try:
        failures = fuzz(service.url)
    finally:
        service.stop(signal.SIGTERM)
    assert not failures, "\n".join(failures)
