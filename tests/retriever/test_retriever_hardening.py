"""The review's client mistakes against the real process: each is a 4xx in the one error body
(never a 500), size limits answer 413 before the work, and the token and request guard hold."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.retriever.conftest import RetrieverProcess, make_pdf, start_retriever

TOKEN = "s3cret-internal-token"
# The limits service: small per-document limits, a token.
MAX_DOCUMENT_CHARS = 5_000
MAX_CHUNKS = 5


def _error(response: httpx.Response, status: int) -> str:
    """The detail of an error answer, after checking its status and the one error body."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"detail", "errors"}, body
    return body["detail"]


def _raw_json(client: httpx.Client, url: str, text: str) -> httpx.Response:
    """A JSON body exactly as written (NaN, lone-surrogate escapes: json.dumps would refuse)."""
    return client.post(url, content=text.encode(), headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("limited-retriever")
    service = start_retriever(
        base / "data",
        base / "retriever.log",
        "--chunk-tokens",
        "32",
        "--max-document-chars",
        str(MAX_DOCUMENT_CHARS),
        "--max-chunks-per-document",
        str(MAX_CHUNKS),
        "--max-body-bytes",
        "4096",
        env={"RAGBLEND_RETRIEVER_INTERNAL_TOKEN": TOKEN},
    )
    yield service
    service.stop()


@pytest.fixture
def authed(limited: RetrieverProcess):
    with httpx.Client(
        base_url=limited.url, timeout=120.0, headers={"authorization": f"Bearer {TOKEN}"}
    ) as http:
        yield http


# -- the 500s of the review ---------------------------------------------------------------------


@pytest.mark.parametrize("offset", ["9223372036854775808", str(2**31 + 1), "-1"])
def test_an_offset_out_of_range_is_422(client, offset):
    _error(client.get("/v1/documents", params={"offset": offset}), 422)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_min_score_is_422(client, value):
    body = f'{{"query": "x", "top_k": 3, "min_score": {value}}}'
    assert "min_score" in _error(_raw_json(client, "/v1/search", body), 422)


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/v1/search", '{"query": "bad \\udc00 text"}'),
        ("/v1/documents", '{"text": "bad \\udc00 text"}'),
        ("/v1/documents", '{"text": "fine", "metadata": {"k": "\\ud800"}}'),
        ("/v1/documents", '{"text": "fine", "metadata": {"k": NaN}}'),
    ],
    ids=["query", "text", "metadata-surrogate", "metadata-nan"],
)
def test_text_that_cannot_be_encoded_is_422(client, url, body):
    _error(_raw_json(client, url, body), 422)


@pytest.mark.parametrize("doc_id", ["a/../../x", "..", "a//b", "./a", "a/.", "bad id", "x" * 201])
def test_an_unsafe_doc_id_is_422_in_the_body_the_form_and_the_path(client, doc_id):
    _error(client.post("/v1/documents", json={"text": "Unsafe id.", "id": doc_id}), 422)
    upload = client.post(
        "/v1/documents", files={"file": ("a.txt", b"Unsafe id.")}, data={"id": doc_id}
    )
    _error(upload, 422)
    # Encoded, so that the client sends the id as it is instead of resolving its dots.
    encoded = doc_id.replace(".", "%2E").replace("/", "%2F").replace(" ", "%20")
    _error(client.get(f"/v1/documents/{encoded}"), 422)
    _error(client.delete(f"/v1/documents/{encoded}"), 422)


def test_a_nested_safe_doc_id_can_be_read_and_deleted(client):
    doc_id = f"team/{uuid.uuid4().hex[:8]}/notes.md"
    assert client.post("/v1/documents", json={"text": "Nested.", "id": doc_id}).status_code == 200
    assert client.get(f"/v1/documents/{doc_id}").json()["doc_id"] == doc_id
    assert client.delete(f"/v1/documents/{doc_id}").status_code == 200


def test_a_pdf_bomb_is_413_not_a_500(client):
    # ~100 KB on the wire, 100 MB once inflated: past pypdf's decompression limit.
    bomb = make_pdf(["A" * 100_000_000], deflate=True)
    assert len(bomb) < 200_000
    response = client.post("/v1/documents", files={"file": ("bomb.pdf", bomb)})
    assert "bomb.pdf" in _error(response, 413)


# -- sizes --------------------------------------------------------------------------------------


def test_a_query_above_100k_chars_is_422(client):
    assert "query" in _error(client.post("/v1/search", json={"query": "x" * 100_001}), 422)


def test_a_long_query_is_truncated_to_the_model_window(client):
    """Were windows averaged, the 99k-char query and its first 5k chars would score apart."""
    text = f"The Quellin observatory keeps a brass telescope [{uuid.uuid4().hex[:8]}]."
    doc = client.post("/v1/documents", json={"text": text}).json()
    head = "Which telescope does the Quellin observatory keep? " + " ".join(
        f"filler{i} words about cooking pasta and rice" for i in range(100)
    )
    long_query = (head + " unrelated tail about sailing boats") * (99_000 // (len(head) + 35))
    assert 5_000 < len(long_query) <= 100_000

    def score(query: str) -> float:
        response = client.post(
            "/v1/search",
            # dense: its score is the cosine of the query's embedding (hybrid's is a rank)
            json={"query": query, "top_k": 1, "doc_ids": [doc["doc_id"]], "retrieval": "dense"},
        )
        assert response.status_code == 200, response.text
        return response.json()["results"][0]["score"]

    assert score(long_query) == pytest.approx(score(long_query[:5_000]), abs=1e-5)


def test_a_body_above_max_body_bytes_is_413_before_it_is_read(client):
    response = client.post("/v1/search", json={"query": "x" * (1024 * 1024)})
    assert "limit is 1048576 bytes" in _error(response, 413)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"query": "x", "doc_ids": [f"d{i}" for i in range(1001)]}, "doc_ids"),
        ({"query": "x", "collections": [f"c{i}" for i in range(65)]}, "collections"),
        ({"query": "x", "collections": ["Not-Lower"]}, "collections"),
        ({"query": "x", "top_k": 10**30}, "top_k"),
    ],
)
def test_search_lists_and_numbers_are_bounded(client, body, field):
    assert field in _error(client.post("/v1/search", json=body), 422)


def test_metadata_above_64_kib_is_422(client):
    response = client.post(
        "/v1/documents", json={"text": "Big metadata.", "metadata": {"k": "v" * 70_000}}
    )
    assert "metadata" in _error(response, 422)


def test_per_document_limits_are_413_naming_the_setting(authed):
    too_long = authed.post("/v1/documents", json={"text": "word " * MAX_DOCUMENT_CHARS})
    assert "max_document_chars" in _error(too_long, 413)
    # Under the character limit, but more than MAX_CHUNKS chunks of 32 tokens.
    many_chunks = authed.post("/v1/documents", json={"text": "word " * 400})
    assert "max_chunks_per_document" in _error(many_chunks, 413)
    pdf = make_pdf(["page " * 600, "page " * 600])
    upload = authed.post("/v1/documents", files={"file": ("long.pdf", pdf)})
    assert "max_document_chars" in _error(upload, 413)
    html = b"<p>" + b"<b></b>" * 4 * MAX_DOCUMENT_CHARS + b"x</p>"
    upload = authed.post("/v1/documents", files={"file": ("markup.html", html)})
    assert "max_document_chars" in _error(upload, 413)
    assert authed.get("/health").json()["documents"] == 0


# -- token and request guard ---------------------------------------------------------------------


def test_the_internal_token_is_required_except_for_health_and_metrics(limited, authed):
    with limited.client() as anonymous:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
        _error(anonymous.post("/v1/search", json={"query": "x"}), 401)
        _error(anonymous.get("/v1/documents"), 401)
        wrong = anonymous.get("/v1/documents", headers={"authorization": "Bearer nope"})
        _error(wrong, 401)
    assert authed.get("/v1/documents").status_code == 200
    assert TOKEN not in limited.log()


def test_a_retriever_beyond_loopback_without_a_token_does_not_start(run_ragblend, tmp_path):
    run = run_ragblend(
        "retriever", "--host", "0.0.0.0", "--data-dir", str(tmp_path), timeout_s=60.0
    )
    assert run.returncode != 0
    assert "internal_token" in run.stderr + run.stdout


@pytest.mark.parametrize(
    ("url", "content_type"),
    [
        ("/v1/search", "text/plain"),
        ("/v1/documents", "text/plain"),
        ("/v1/documents", "application/x-www-form-urlencoded"),
        ("/v1/search", "multipart/form-data; boundary=x"),
    ],
)
def test_a_body_that_is_not_json_or_an_upload_is_415(client, url, content_type):
    response = client.post(url, content=b'{"query": "x"}', headers={"content-type": content_type})
    _error(response, 415)


def test_a_cross_site_browser_upload_is_403(client):
    response = client.post(
        "/v1/documents",
        files={"file": ("a.txt", b"Planted by another site.")},
        headers={"origin": "https://evil.example"},
    )
    assert "origin" in _error(response, 403)
    search = client.post(
        "/v1/search", json={"query": "x"}, headers={"origin": "https://evil.example"}
    )
    _error(search, 403)


def test_errors_keep_the_one_body_with_field_errors(client):
    response = client.post("/v1/search", json={"query": "x", "top_k": "many"})
    detail = _error(response, 422)
    assert "top_k" in detail
    assert response.json()["errors"][0]["loc"] == ["body", "top_k"]
    assert json.loads(json.dumps(response.json()))  # plain JSON, nothing exotic
