"""What a hostile client or web page cannot do: ids that climb to another route, cross-site
requests, form posts, and internal addresses or paths in what clients see."""

from __future__ import annotations

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "Kessa pass?"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "doc_id",
    [
        "..%2F..%2Fhealth",
        "..%2F..%2Fv1%2Fsearch",
        "a%2F..%2F..%2Fhealth",
        "%2E%2E",
        "a%2F%2Fb",
        "x%3Fcollection%3Dother",
        "x" * 201,
    ],
)
def test_a_doc_id_that_could_name_another_route_is_a_422(client, retriever, doc_id):
    before = retriever.log().count("GET /health")
    for method in ("GET", "DELETE"):
        response = client.request(method, f"/v1/documents/{doc_id}")
        assert response.status_code == 422, response.text
        assert response.json()["detail"].startswith("path.doc_id")
    assert retriever.log().count("GET /health") == before


def test_an_id_with_slashes_is_forwarded_to_its_own_document(client):
    created = client.post(
        "/v1/documents", json={"text": "Notes of the spring fair in Quendor.", "id": "notes/2026"}
    )
    assert created.status_code == 200, created.text
    assert client.get("/v1/documents/notes/2026").json()["doc_id"] == "notes/2026"
    assert client.delete("/v1/documents/notes%2F2026").status_code == 200


def test_a_cross_site_or_form_post_is_refused_before_any_route_runs(client):
    foreign = client.post(
        "/v1/query", json={"question": "x"}, headers={"Origin": "http://evil.example"}
    )
    assert foreign.status_code == 403 and "evil.example" in foreign.json()["detail"]
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        planted = client.post(
            "/v1/documents",
            content=b'{"text": "planted by a web page", "id": "planted"}',
            headers={"Content-Type": content_type},
        )
        assert planted.status_code == 415, planted.text
    assert client.get("/v1/documents/planted").status_code == 404
    # CORS is off by default: a preflight gets no permission.
    preflight = client.options(
        "/v1/query",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_allows_only_the_configured_origins(spawn_gateway, engine, documents):
    app = "http://app.example"
    gateway = spawn_gateway(engine, args=("--cors-origins", app))
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        preflight = http.options(
            "/v1/query",
            headers={
                "Origin": app,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == app
        allowed = http.post(
            "/v1/query", json={"question": "Kessa pass?", "max_tokens": 2}, headers={"Origin": app}
        )
        assert allowed.status_code == 200, allowed.text
        assert allowed.headers["access-control-allow-origin"] == app
        foreign = http.post(
            "/v1/query", json={"question": "x"}, headers={"Origin": "http://evil.example"}
        )
        assert foreign.status_code == 403


def test_clients_never_see_internal_addresses_or_the_model_path(
    client, gateway, engine, retriever, tiny_model
):
    answers = [
        client.get("/health"),
        client.get("/ready"),
        client.post("/v1/query", json={"question": "Kessa pass?", "max_tokens": 2}),
        client.post("/v1/chat/completions", json=CHAT),
        client.post("/v1/chat/completions", json={**CHAT, "stream": True}),
        client.get("/v1/documents/rivers"),
    ]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        seen = answer.text + str(answer.headers)
        for secret in (engine.url, retriever.url, "127.0.0.1", tiny_model):
            assert secret not in seen, (answer.request.url, secret)
    assert client.get("/health").json() == {"status": "ok", "engines": 1}
    assert answers[2].json()["engine"] == "engine-0"
    assert answers[4].headers["X-RAGBlend-Engine"] == "engine-0"
    # The operator's log keeps the addresses.
    assert engine.url in gateway.log()
