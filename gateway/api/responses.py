"""The statuses each route declares in the OpenAPI spec: errors with the one error body
(common.errors), and SSE for the generating routes; the routes' `responses=` take these."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorBody(BaseModel):
    detail: str
    errors: list[dict[str, Any]]


def declare(**statuses: str) -> dict[int | str, dict[str, Any]]:
    """{status: description} as FastAPI's `responses`, e.g. declare(s404="unknown document")."""
    return {
        int(key.removeprefix("s")): {"model": ErrorBody, "description": description}
        for key, description in statuses.items()
    }


# Every route but /health and /ready, when API keys are configured.
_KEYED = {"s401": "missing or invalid API key"}
_DEPENDENCY = {
    "s502": "a dependency failed (5xx, a broken stream)",
    "s503": "a dependency is down (Retry-After)",
    "s504": "a dependency did not answer in time",
}
_POSTED = {
    "s400": "a body that cannot be parsed (not UTF-8, a multipart without boundary); on the "
    "OpenAI routes also a field that would change the output and is not supported; a "
    "response_format whose JSON schema does not compile",
    "s403": "a collection the API key may not use, or a foreign Origin",
    "s413": "request body too large",
    "s415": "content type not accepted",
    "s422": "invalid request (detail names the field)",
}

# One server-sent event: its `event` name (none on the OpenAI routes) and JSON `data`.
SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
KEYED = declare(**_KEYED)
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    # With `stream: true` the answer is server-sent events.
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
    **declare(
        **_KEYED,
        **_POSTED,
        s404="an unknown doc_id",
        s429="max_concurrency queries in flight, or the engine's queue is full (Retry-After)",
        **_DEPENDENCY,
    ),
}
DOCUMENT_READ_ERRORS = declare(
    **_KEYED,
    s403="a collection the API key may not use",
    s404="unknown document",
    s422="invalid id or query parameter",
    **_DEPENDENCY,
)
DOCUMENT_LIST_ERRORS = declare(
    **_KEYED,
    s403="a collection the API key may not use",
    s422="invalid query parameter",
    **_DEPENDENCY,
)
DOCUMENT_DELETE_ERRORS = declare(
    **_KEYED,
    s403="a collection the API key may not use, or a foreign Origin",
    s404="unknown document",
    s415="content type not accepted",
    s422="invalid id or query parameter",
    **_DEPENDENCY,
)
DOCUMENT_CREATE_ERRORS = declare(
    **_KEYED,
    **_POSTED,
    **_DEPENDENCY,
)
READY_ERRORS = declare(s503="the retriever or every engine is down")
