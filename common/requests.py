"""Who may send a state-changing request, and in what form: a cross-site browser request (an
`Origin` not allowed) is refused with 403, and a body that is not the declared content type
(JSON, or multipart where a route takes uploads) with 415, before any route runs."""

from __future__ import annotations

from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from common.errors import send_error

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON = "application/json"
MULTIPART = "multipart/form-data"


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def media_type(content_type: str | None) -> str | None:
    """`application/json; charset=utf-8` -> `application/json`."""
    if content_type is None:
        return None
    return content_type.split(";", 1)[0].strip().lower() or None


class RequestGuardMiddleware:
    """For POST, PUT, PATCH and DELETE:

    - an `Origin` header outside `allowed_origins` is a browser sending on behalf of another
      site (a "simple" form post needs no CORS preflight), so 403;
    - a body must be JSON, or multipart on `multipart_paths`; anything else is 415 (a
      `text/plain` body is how a web page smuggles JSON past CORS).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed_origins: Collection[str] = (),
        multipart_paths: Collection[str] = (),
    ):
        self.app = app
        self.allowed_origins = frozenset(o.rstrip("/") for o in allowed_origins)
        self.multipart_paths = frozenset(multipart_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        origin = header(scope, b"origin")
        if origin is not None and origin.rstrip("/") not in self.allowed_origins:
            await send_error(send, 403, f"requests from origin {origin[:200]} are not allowed")
            return
        declared = media_type(header(scope, b"content-type"))
        accepted = {JSON, MULTIPART} if scope["path"] in self.multipart_paths else {JSON}
        if declared is not None and declared not in accepted:
            await send_error(
                send,
                415,
                f"content type {declared[:100]} is not accepted here: send "
                + " or ".join(sorted(accepted)),
            )
            return
        await self.app(scope, receive, send)
