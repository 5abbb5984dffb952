"""Exception handlers: dependency failures and bad input become the one error body, whose
`detail` names the dependency or the field (plus OpenAI's `error` object on the OpenAI routes)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import FieldError, error_body, field_errors, validation_detail
from gateway.errors import (
    DependencyBusyError,
    DependencyFailedError,
    DependencyRejectedError,
    DependencyTimeoutError,
    DependencyUnavailableError,
)

log = logging.getLogger(__name__)
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
# A dependency's 4xx that is the client's problem too; any other means the gateway sent
# something wrong, which is no client's fault.
PASSED_ON = frozenset({400, 404, 413, 415, 422})


def error_response(
    request: Request,
    status: int,
    detail: object,
    headers: dict[str, str] | None = None,
    errors: Sequence[FieldError] = (),
) -> JSONResponse:
    """The one error body (common.errors), plus OpenAI's `error` object on the OpenAI routes."""
    content = error_body(detail, errors)
    if request.url.path in OPENAI_PATHS:
        content["error"] = {
            "message": content["detail"],
            "type": OPENAI_TYPES.get(status, "api_error"),
            "code": status,
        }
    return JSONResponse(content, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        return error_response(request, 422, validation_detail(errors), errors=field_errors(errors))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, exc.detail, exc.headers)

    @app.exception_handler(DependencyUnavailableError)
    async def unavailable(request: Request, exc: DependencyUnavailableError) -> JSONResponse:
        return error_response(request, 503, str(exc), {"Retry-After": "1"})

    @app.exception_handler(DependencyBusyError)
    async def busy(request: Request, exc: DependencyBusyError) -> JSONResponse:
        return error_response(request, 429, str(exc), {"Retry-After": exc.retry_after_s})

    @app.exception_handler(DependencyRejectedError)
    async def rejected(request: Request, exc: DependencyRejectedError) -> JSONResponse:
        # The dependency's 4xx is the client's problem too (a prompt too long for the model,
        # an unknown doc_id): same status, its detail prefixed with who said so.
        if exc.status_code not in PASSED_ON:
            log.error("%s", exc)
            return error_response(request, 502, f"{exc.dependency} failed: unexpected answer")
        return error_response(request, exc.status_code, f"{exc.dependency}: {exc.detail}")

    @app.exception_handler(DependencyTimeoutError)
    async def timed_out(request: Request, exc: DependencyTimeoutError) -> JSONResponse:
        return error_response(request, 504, str(exc))

    @app.exception_handler(DependencyFailedError)
    async def failed(request: Request, exc: DependencyFailedError) -> JSONResponse:
        return error_response(request, 502, str(exc))
