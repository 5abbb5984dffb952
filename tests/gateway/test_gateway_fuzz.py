"""Schemathesis over the gateway's OpenAPI spec, against live retriever, engine and gateway
processes: no 5xx, and only the statuses each operation declares."""

from __future__ import annotations

from tests.openapi_fuzz import fuzz


def test_gateway_answers_generated_requests_with_declared_statuses_and_no_5xx(
    spawn_gateway, engine, documents
):
    # Generated queries stay cheap: a few tokens each, few chunks.
    gateway = spawn_gateway(engine, args=("--max-tokens-limit", "4", "--max-top-k", "4"))
    failures = fuzz(gateway.url)
    assert not failures, "\n".join(failures)
