"""The request guard before any route: a state-changing request from a foreign origin is a 403,
a body that is neither JSON nor (where uploads are taken) multipart is a 415."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from common.requests import RequestGuardMiddleware, media_type


@pytest.mark.parametrize(
    ("content_type", "media"),
    [
        ("application/json", "application/json"),
        ("Application/JSON; charset=utf-8", "application/json"),
        ("multipart/form-data; boundary=x", "multipart/form-data"),
        (";", None),
        (None, None),
    ],
)
def test_the_media_type_is_the_content_type_without_parameters(content_type, media):
    assert media_type(content_type) == media


def client() -> TestClient:
    app = FastAPI()
    app.add_middleware(
        RequestGuardMiddleware,
        allowed_origins=["https://app.example/"],
        multipart_paths=["/v1/documents"],
    )

    @app.api_route("/v1/query", methods=["GET", "POST", "DELETE"])
    @app.post("/v1/documents")
    async def accept(request: Request) -> dict:
        return {"read": len(await request.body())}

    return TestClient(app)


def test_a_post_from_a_foreign_origin_is_a_403():
    response = client().post("/v1/query", json={}, headers={"Origin": "https://evil.example"})
    assert response.status_code == 403
    assert response.json()["detail"] == "requests from origin https://evil.example are not allowed"


@pytest.mark.parametrize("origin", ["https://app.example", "https://app.example/"])
def test_an_allowed_origin_passes_with_or_without_its_slash(origin):
    assert client().post("/v1/query", json={}, headers={"Origin": origin}).status_code == 200


def test_a_safe_method_passes_from_any_origin_with_any_body():
    headers = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    assert client().get("/v1/query", headers=headers).status_code == 200


@pytest.mark.parametrize("method", ["POST", "DELETE"])
def test_a_text_plain_body_is_a_415_naming_what_is_accepted(method):
    response = client().request(
        method, "/v1/query", content=b"{}", headers={"Content-Type": "text/plain"}
    )
    assert response.status_code == 415
    assert response.json()["detail"] == (
        "content type text/plain is not accepted here: send application/json"
    )


def test_multipart_is_accepted_only_where_uploads_are_taken():
    upload = {"file": ("a.txt", b"hello", "text/plain")}
    assert client().post("/v1/documents", files=upload).status_code == 200
    response = client().post("/v1/query", files=upload)
    assert response.status_code == 415
    assert response.json()["detail"].endswith("send application/json")


def test_a_json_body_and_a_body_without_content_type_reach_the_route():
    service = client()
    json_body = {"Content-Type": "application/json; charset=utf-8"}
    assert service.post("/v1/query", content=b'{"q": 1}', headers=json_body).json() == {"read": 8}
    assert service.post("/v1/query", content=b"{}").json() == {"read": 2}
