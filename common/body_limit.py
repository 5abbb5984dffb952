"""The request body size limit of every service: a 413 before the body is read whole (the
limits of the bodies' fields are the wire contract's, common.contract)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import send_error


class BodySizeLimitMiddleware:
    """Bodies above `max_bytes` (or above `path_limits[path]` for the paths named there, e.g. a
    larger one for uploads) are refused with 413 and never read whole."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, path_limits: Mapping[str, int] | None = None
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    def limit_of(self, path: str) -> int:
        return self.path_limits.get(path, self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_of(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _send_413(send, limit)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException: FastAPI's body parsing passes it on unchanged, and the
                    # app's handlers answer it in the one error body.
                    raise HTTPException(413, detail=_too_large(limit))
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except HTTPException as exc:
            # Raised where no handler of the app saw it (e.g. in another middleware).
            if exc.status_code != 413 or started:
                raise
            await _send_413(send, limit)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(limit: int) -> str:
    return f"request body too large: the limit is {limit} bytes"


async def _send_413(send: Send, limit: int) -> None:
    # Connection: close: the unread rest of the body must not be taken for the next request.
    await send_error(send, 413, _too_large(limit), [(b"connection", b"close")])
