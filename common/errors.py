"""The one error body of every service, `{"detail": "...", "errors": [...]}`, and the FastAPI
exception handlers that send it (docs/architecture.md)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

FieldError = dict[str, Any]  # {"loc": [...], "msg": str, "type": str}


def error_body(detail: object, errors: Sequence[FieldError] = ()) -> dict[str, Any]:
    """`detail`: one readable line saying what is wrong; `errors`: one entry per bad field of a
    request that failed validation, else empty."""
    text = detail if isinstance(detail, str) else json.dumps(detail)
    return {"detail": text, "errors": list(errors)}


def field_errors(errors: Sequence[Mapping[str, Any]]) -> list[FieldError]:
    """Pydantic's errors, JSON-safe (their `ctx` and `input` may hold any object)."""
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]


def validation_detail(errors: Sequence[Mapping[str, Any]]) -> str:
    """One readable line per problem, naming the field (`body.top_k` → `top_k`)."""
    problems = []
    for error in errors:
        if error["type"] == "json_invalid":
            problems.append(f"body: malformed JSON ({error.get('ctx', {}).get('error', '')})")
            continue
        where = ".".join(str(p) for p in error["loc"] if p != "body") or "body"
        problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)


def error_response(
    status: int,
    detail: object,
    errors: Sequence[FieldError] = (),
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(detail, errors), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """422 for a request that fails validation, and every HTTPException, in the one body."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, validation_detail(exc.errors()), field_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, exc.detail, headers=exc.headers)


async def send_error(
    send: Send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """The one error body sent straight from an ASGI middleware, before any route runs."""
    body = json.dumps(error_body(detail)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
