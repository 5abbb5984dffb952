"""API keys (`Authorization: Bearer`) and the collections each may use, and the internal
token the gateway sends to the retriever and the engines."""

from __future__ import annotations

import hashlib
import json

import httpx
import openai
import pytest
from openai import OpenAI

ALICE, BOB, ADMIN = "alice-secret-key", "bob-secret-key", "admin-secret-key"
SECRET_TEXT = "The vault of Brannoch holds seven copper keys under the old mill."


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed_gateway(spawn_gateway, engine, tmp_path_factory):
    """alice may use collection a, bob b (his key stored as its hash), admin every one."""
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps(
            [
                {"name": "alice", "key": ALICE, "collections": ["a"]},
                {
                    "name": "bob",
                    "sha256": hashlib.sha256(BOB.encode()).hexdigest(),
                    "collections": ["b"],
                },
                {"name": "admin", "key": ADMIN, "collections": ["*"]},
            ]
        )
    )
    return spawn_gateway(engine, args=("--api-keys-file", str(keys)))


@pytest.fixture(scope="module")
def planted(keyed_gateway):
    """bob's secret document in collection b, alice's own in a."""
    with httpx.Client(base_url=keyed_gateway.url, timeout=120) as http:
        secret = http.post(
            "/v1/documents", json={"text": SECRET_TEXT, "id": "vault"}, headers=bearer(BOB)
        )
        assert secret.status_code == 200, secret.text
        assert secret.json()["collection"] == "b"
        own = http.post(
            "/v1/documents",
            json={"text": "Alice keeps bees near the river of Quendor.", "id": "bees"},
            headers=bearer(ALICE),
        )
        assert own.status_code == 200 and own.json()["collection"] == "a"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/query"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/documents"),
        ("GET", "/v1/documents/vault"),
        ("DELETE", "/v1/documents/vault"),
        ("GET", "/metrics"),
    ],
)
def test_every_route_but_the_probes_needs_a_known_key(keyed_gateway, method, path):
    with httpx.Client(base_url=keyed_gateway.url, timeout=60) as http:
        for headers in ({}, bearer("wrong-key"), {"Authorization": "Basic YWxpY2U6eA=="}):
            response = http.request(method, path, headers=headers, json={})
            assert response.status_code == 401, (headers, response.text)
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert response.json()["detail"].split(":")[0] in ("missing API key", "invalid API key")
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200


def test_a_key_cannot_touch_another_collections_documents(keyed_gateway, planted):
    with httpx.Client(base_url=keyed_gateway.url, timeout=60, headers=bearer(ALICE)) as http:
        for response in (
            http.get("/v1/documents", params={"collection": "b"}),
            http.get("/v1/documents/vault", params={"collection": "b"}),
            http.delete("/v1/documents/vault", params={"collection": "b"}),
            http.post("/v1/documents?collection=b", json={"text": "planted", "id": "x"}),
            http.post("/v1/query", json={"question": "vault?", "collections": ["b"]}),
            http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "vault?"}],
                    "rag": {"collections": ["b"]},
                },
            ),
        ):
            assert response.status_code == 403, response.text
            assert "collection b" in response.json()["detail"]
    with httpx.Client(base_url=keyed_gateway.url, timeout=60, headers=bearer(BOB)) as http:
        assert http.get("/v1/documents/vault").status_code == 200  # still there


def test_a_keys_queries_and_reads_see_only_its_collections(keyed_gateway, planted):
    with httpx.Client(base_url=keyed_gateway.url, timeout=120, headers=bearer(ALICE)) as http:
        answer = http.post("/v1/query", json={"question": SECRET_TEXT, "top_k": 4})
        assert answer.status_code == 200, answer.text
        assert answer.json()["sources"], "alice's own document is found"
        assert {s["collection"] for s in answer.json()["sources"]} == {"a"}
        assert "vault" not in {s["doc_id"] for s in answer.json()["sources"]}
        assert http.get("/v1/documents/vault").status_code == 404
        assert "vault" not in {d["doc_id"] for d in http.get("/v1/documents").json()["documents"]}
    with httpx.Client(base_url=keyed_gateway.url, timeout=120, headers=bearer(ADMIN)) as http:
        answer = http.post("/v1/query", json={"question": SECRET_TEXT, "top_k": 4})
        assert "vault" in {s["doc_id"] for s in answer.json()["sources"]}


def test_openai_clients_send_their_key_unchanged_and_the_log_names_it(keyed_gateway, planted):
    client = OpenAI(base_url=f"{keyed_gateway.url}/v1", api_key=ALICE, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="ragblend", max_tokens=2, messages=[{"role": "user", "content": "Who keeps bees?"}]
    )
    assert reply.model_extra["rag"]["collections"] == ["a"]
    stranger = OpenAI(base_url=f"{keyed_gateway.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    log = keyed_gateway.log()
    assert "key=alice" in log
    assert all(secret not in log for secret in (ALICE, BOB, ADMIN, "nope"))


def test_a_bad_keys_file_stops_the_gateway_at_startup(tmp_path):
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "x", "collections": ["a"]}]))
    with pytest.raises(ValidationError, match="exactly one of key and sha256"):
        GatewaySettings(api_keys_file=path)
    path.write_text(json.dumps([{"name": "x", "key": "k", "collections": ["Not A Name"]}]))
    with pytest.raises(ValidationError, match="api_keys_file"):
        GatewaySettings(api_keys_file=path)


def test_the_internal_token_reaches_the_retriever_and_the_engine(
    spawn_retriever, spawn_engine, spawn_gateway
):
    token = "internal-shared-token"
    retriever = spawn_retriever("--internal-token", token)
    engine = spawn_engine("--internal-token", token)
    trusted = spawn_gateway(
        engine, args=("--retriever-url", retriever.url, "--internal-token", token)
    )
    untrusted = spawn_gateway(engine, args=("--retriever-url", retriever.url))
    with httpx.Client(base_url=trusted.url, timeout=120) as http:
        created = http.post("/v1/documents", json={"text": SECRET_TEXT, "id": "vault"})
        assert created.status_code == 200, created.text
        answer = http.post("/v1/query", json={"question": "vault?", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
    with httpx.Client(base_url=untrusted.url, timeout=120) as http:
        refused = http.post("/v1/query", json={"question": "vault?"})
        assert refused.status_code == 502
        assert refused.json()["detail"] == "retriever failed: refused the gateway's credentials"
    assert token not in trusted.log()
