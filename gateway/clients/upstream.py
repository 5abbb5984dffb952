"""One dependency behind an httpx.AsyncClient: retries with backoff for idempotent calls and
the mapping of its failures onto the gateway's named errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx

from common.request_id import REQUEST_ID_HEADER
from gateway.errors import (
    DependencyBusyError,
    DependencyFailedError,
    DependencyRejectedError,
    DependencyUnavailableError,
)

log = logging.getLogger(__name__)
RETRYABLE_STATUS = frozenset({502, 503, 504})

ErrorHook = Callable[[str, str], None]  # (dependency, kind) -> None, for metrics


def detail_of(response: httpx.Response) -> str:
    """The `detail` of a FastAPI error body as one line (pydantic error lists included)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    detail: Any = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):
        return "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            if isinstance(e, dict)
            else str(e)
            for e in detail
        )
    return str(detail)


class Upstream:
    """Calls to one dependency named `name` (it names the dependency in every error)."""

    def __init__(
        self,
        name: str,
        client: httpx.AsyncClient,
        *,
        retries: int,
        backoff_s: float,
        on_error: ErrorHook,
    ):
        self.name = name
        self.client = client
        self.retries = retries
        self.backoff_s = backoff_s
        self.on_error = on_error

    async def request(
        self,
        method: str,
        url: str,
        *,
        request_id: str,
        timeout: httpx.Timeout,
        idempotent: bool,
        **kwargs: Any,
    ) -> httpx.Response:
        """The 2xx response; raises a Dependency*Error otherwise. Only idempotent calls are
        retried (transport errors and 502/503/504), with doubling backoff."""
        headers = {**kwargs.pop("headers", {}), REQUEST_ID_HEADER: request_id}
        tries = 1 + (self.retries if idempotent else 0)
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = await self.client.request(
                    method, url, headers=headers, timeout=timeout, **kwargs
                )
            except httpx.TransportError as exc:
                error: Exception = self.unavailable(exc)
            else:
                if response.status_code not in RETRYABLE_STATUS:
                    return self.check(response)
                error = self.status_error(response)
            if attempt + 1 < tries:
                log.warning("%s %s %s failed (%s); retrying", self.name, method, url, error)
        raise error

    def unavailable(self, exc: Exception) -> DependencyUnavailableError:
        self.on_error(self.name, "unavailable")
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return DependencyUnavailableError(self.name, reason)

    def check(self, response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        raise self.status_error(response)

    def status_error(self, response: httpx.Response) -> Exception:
        status = response.status_code
        detail = detail_of(response)
        if status == 429:
            self.on_error(self.name, "busy")
            return DependencyBusyError(self.name, detail, response.headers.get("Retry-After", "1"))
        if status == 503:
            self.on_error(self.name, "unavailable")
            return DependencyUnavailableError(self.name, f"HTTP 503: {detail}")
        if status < 500:
            self.on_error(self.name, "rejected")
            return DependencyRejectedError(self.name, status, detail)
        self.on_error(self.name, "failed")
        return DependencyFailedError(self.name, f"HTTP {status}: {detail}")
