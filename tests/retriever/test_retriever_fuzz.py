"""Schemathesis over the retriever's OpenAPI spec, against a live process: no 5xx, and only
the statuses each operation declares."""

from __future__ import annotations

import signal

from tests.openapi_fuzz import fuzz
from tests.retriever.conftest import start_retriever


def test_retriever_answers_generated_requests_with_declared_statuses_and_no_5xx(tmp_path):
    service = start_retriever(tmp_path / "data", tmp_path / "retriever.log", "--chunk-tokens", "64")
    try:
        with service.client() as http:
            http.post("/v1/documents", json={"id": "seed/doc", "text": "Goulpu is a tailor."})
        failures = fuzz(service.url)
    finally:
        service.stop(signal.SIGTERM)
    assert not failures, "\n".join(failures)
