"""Bearer tokens: the shared token that the gateway sends to the internal services (required
when they listen beyond loopback), and the parsing that the gateway's API keys reuse."""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from common.errors import send_error

# Probes and scrapes: no data behind them, and Docker healthchecks and Prometheus call them.
INTERNAL_OPEN_PATHS = frozenset({"/health", "/metrics"})


def bearer_token(scope: Scope) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def tokens_match(given: str, expected: str) -> bool:
    """Constant-time comparison: the time taken does not tell how much of a guess is right."""
    return hmac.compare_digest(given.encode(), expected.encode())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(service: str, host: str, token: str | None) -> None:
    """An internal service that listens beyond loopback must require the shared token."""
    if token is None and not is_loopback(host):
        raise ValueError(
            f"the {service} listens on {host}, beyond loopback, without internal_token: set "
            f"RAGBLEND_INTERNAL_TOKEN (the same value on the gateway and every internal service)"
        )


async def send_unauthorized(send: Send, detail: str) -> None:
    await send_error(send, 401, detail, [(b"www-authenticate", b"Bearer")])


class InternalTokenMiddleware:
    """With a token configured, every request outside INTERNAL_OPEN_PATHS must carry it as
    `Authorization: Bearer <token>`, else 401; without one, everything passes (loopback)."""

    def __init__(self, app: ASGIApp, *, token: str | None):
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.token is not None
            and scope["type"] == "http"
            and scope["path"] not in INTERNAL_OPEN_PATHS
        ):
            given = bearer_token(scope)
            if given is None or not tokens_match(given, self.token):
                await send_unauthorized(send, "missing or wrong internal token")
                return
        await self.app(scope, receive, send)
