"""Every service answers errors with the one body `{"detail": str, "errors": [...]}`."""

from __future__ import annotations

from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from common.errors import error_body, install_error_handlers


class Body(BaseModel):
    top_k: int = Field(ge=1)
    query: str


def _client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/search")
    async def search(body: Body) -> dict:
        raise HTTPException(404, detail=f"unknown query {body.query!r}")

    return TestClient(app)


def test_a_request_failing_validation_gets_a_422_naming_each_field_in_one_line():
    response = _client().post("/search", json={"top_k": 0})
    assert response.status_code == 422
    body = response.json()
    assert set(body) == {"detail", "errors"}
    assert body["detail"].startswith("top_k: ") and "; query: " in body["detail"]
    assert [e["loc"] for e in body["errors"]] == [["body", "top_k"], ["body", "query"]]
    assert all(set(e) == {"loc", "msg", "type"} for e in body["errors"])


def test_malformed_json_is_a_422_that_says_so():
    response = _client().post("/search", content=b"{", headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("body: malformed JSON")


def test_an_http_exception_keeps_its_status_and_detail_with_no_field_errors():
    response = _client().post("/search", json={"top_k": 1, "query": "x"})
    assert (response.status_code, response.json()) == (
        404,
        {"detail": "unknown query 'x'", "errors": []},
    )


def test_a_detail_that_is_not_text_is_sent_as_its_json_text():
    assert error_body({"a": 1}) == {"detail": '{"a": 1}', "errors": []}
