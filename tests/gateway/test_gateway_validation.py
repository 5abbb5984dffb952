"""Limits on what a client may send: body size (413 before the body is read), text lengths,
counts, encodable text, finite numbers and 64-bit seeds (422), on every generating route."""

from __future__ import annotations

import socket
import time

import pytest

from common.contract import MAX_STOP_CHARS

CHAT = {"messages": [{"role": "user", "content": "Kessa pass?"}], "max_tokens": 2}


def raw_post(url: str, path: str, body: bytes, content_length: int | None = None) -> bytes:
    """The status line of a POST whose Content-Length may claim more than is sent."""
    host, port = url.removeprefix("http://").split(":")
    length = len(body) if content_length is None else content_length
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
            + body
        )
        return sock.recv(4096).split(b"\r\n", 1)[0]


def test_a_body_above_the_limit_is_a_413_from_its_content_length_alone(gateway):
    start = time.monotonic()
    # 60 MB announced, none sent: the answer cannot have waited for the body.
    assert b" 413 " in raw_post(gateway.url, "/v1/query", b"", content_length=60_000_000)
    assert b" 413 " in raw_post(gateway.url, "/v1/documents", b"", content_length=60_000_000)
    assert time.monotonic() - start < 5


def test_a_streamed_body_above_the_limit_is_a_413(client):
    def chunks():
        yield b'{"question": "'
        for _ in range(2 * 1024):
            yield b"x" * 1024
        yield b'"}'

    response = client.post(
        "/v1/query", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert "limit is 1048576 bytes" in response.json()["detail"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/query", {"question": "x" * 100_001}, "question"),
        ("/v1/query", {"question": "x", "seed": 2**64}, "seed"),
        ("/v1/query", {"question": "x", "stop": ["s"] * 17}, "stop"),
        ("/v1/query", {"question": "x", "stop": ["s" * (MAX_STOP_CHARS + 1)]}, "stop.0"),
        ("/v1/query", {"question": "x", "doc_ids": ["../etc"]}, "doc_ids.0"),
        ("/v1/query", {"question": "x", "collections": ["Not A Name"]}, "collections.0"),
        ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "seed"),
        ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 100_001}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}] * 257},
            "messages",
        ),
        ("/v1/chat/completions", {**CHAT, "rag": {"doc_ids": ["a/../b"]}}, "rag.doc_ids.0"),
        ("/v1/completions", {"prompt": "x" * 100_001}, "prompt"),
        ("/v1/completions", {"prompt": ["x"] * 17}, "prompt"),
        ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ],
)
def test_oversized_or_out_of_range_input_is_a_422_naming_the_field(client, path, body, field):
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    assert field in response.json()["detail"]


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        ("/v1/query", b'{"question": "\\udc00"}', "question"),
        ("/v1/query", b'{"question": "x", "temperature": NaN}', "temperature"),
        ("/v1/query", b'{"question": "x", "top_p": Infinity}', "top_p"),
        ("/v1/query", b'{"question": "x", "recompute_ratio": NaN}', "recompute_ratio"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800 hi"}]}',
            "messages.0.content",
        ),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "stop": "\\udfff"}', "stop"),
    ],
)
def test_lone_surrogates_and_non_finite_numbers_are_a_422(client, path, raw, field):
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert field in response.json()["detail"]


def sampled_answer(client, seed: int) -> str:
    """The answer to one question sampled hot (temperature 2) with `seed`."""
    ask = {"question": "Kessa pass?", "temperature": 2.0, "max_tokens": 8, "seed": seed}
    response = client.post("/v1/query", json=ask)
    assert response.status_code == 200, response.text
    return response.json()["answer"]


def test_a_seed_of_64_bits_reaches_the_engine(client):
    seed = 2**63 - 1  # a float on the way would round it and its neighbours to 2**63
    answer = sampled_answer(client, seed)
    assert sampled_answer(client, seed) == answer
    # Neighbours, not seeds 2**32 apart: torch's CPU generator reads only the low 32 bits.
    others = [sampled_answer(client, seed - k) for k in (1, 2, 3)]
    assert any(other != answer for other in others), answer


def test_an_unparsable_upload_is_the_retrievers_400(client):
    response = client.post("/v1/documents", headers={"Content-Type": "multipart/form-data"})
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith("retriever:")
