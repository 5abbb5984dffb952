"""The shared internal token: a bearer header parsed leniently, compared in constant time,
required by an internal service beyond loopback, and checked on every route but the probes."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from common.auth import (
    InternalTokenMiddleware,
    bearer_token,
    check_exposure,
    is_loopback,
    tokens_match,
)


def scope_with(*headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "headers": list(headers)}


@pytest.mark.parametrize(
    ("value", "token"),
    [
        (b"Bearer abc", "abc"),
        (b"bearer  abc ", "abc"),
        (b"BEARER abc", "abc"),
        (b"Basic abc", None),
        (b"Bearer ", None),
        (b"Bearer", None),
    ],
)
def test_a_bearer_token_is_read_whatever_the_schemes_case_and_spaces(value, token):
    assert bearer_token(scope_with((b"authorization", value))) == token


def test_no_authorization_header_is_no_token():
    assert bearer_token(scope_with((b"x-other", b"Bearer abc"))) is None


def test_tokens_match_only_when_equal():
    assert tokens_match("s3cret", "s3cret")
    assert not tokens_match("s3cre", "s3cret") and not tokens_match("", "s3cret")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("::", False),
        ("engine.internal", False),
    ],
)
def test_only_loopback_addresses_and_localhost_are_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_an_internal_service_beyond_loopback_needs_the_token():
    with pytest.raises(ValueError, match="RAGBLEND_INTERNAL_TOKEN"):
        check_exposure("engine", "0.0.0.0", None)
    check_exposure("engine", "0.0.0.0", "s3cret")
    check_exposure("engine", "127.0.0.1", None)


def client(token: str | None) -> TestClient:
    app = FastAPI()
    app.add_middleware(InternalTokenMiddleware, token=token)

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.post("/v1/generate")
    async def generate() -> dict:
        return {"text": "hi"}

    return TestClient(app)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_a_request_without_the_right_token_is_a_401_asking_for_a_bearer(headers):
    response = client("s3cret").post("/v1/generate", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {"detail": "missing or wrong internal token", "errors": []}


def test_the_right_token_passes_and_the_probes_need_none():
    service = client("s3cret")
    ok = service.post("/v1/generate", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json() == {"text": "hi"}
    assert service.get("/health").status_code == 200


def test_without_a_configured_token_every_request_passes():
    assert client(None).post("/v1/generate").status_code == 200
