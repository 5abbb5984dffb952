"""The request id (`X-Request-ID`) of the request being served, carried into every log line
of every service: a context variable, a logging filter and a small ASGI middleware."""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-ID"
# ASGI carries header names lower-cased, as bytes.
HEADER = REQUEST_ID_HEADER.lower().encode("latin-1")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
request_id_var: ContextVar[str] = ContextVar("ragblend_request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record, so the log format may print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    # One INFO line per outgoing HTTP call drowns the services' own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def request_id_of(scope: Scope) -> str:
    """The caller's X-Request-ID, or a new one."""
    for name, value in scope.get("headers", ()):
        if name == HEADER:
            # A client's id is kept (so its logs join ours) but bounded and printable.
            text = value.decode("latin-1").strip()[:128]
            if text.isprintable() and text:
                return text
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Sets the request id for the request's lifetime and echoes it in the response."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        token = request_id_var.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((HEADER, request_id.encode("latin-1")))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
