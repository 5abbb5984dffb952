"""One dependency behind an httpx.AsyncClient: retries of the failures a retry can cure, a
bound on the total wait, and the mapping of its failures onto the gateway's named errors."""

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
    DependencyTimeoutError,
    DependencyUnavailableError,
)

log = logging.getLogger(__name__)
# A dependency restarting (502 from a proxy, 503 before its model is loaded): a retry may help.
RETRYABLE_STATUS = frozenset({502, 503})
# Nothing reached the dependency, so any call may be sent again.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)

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


def auth_headers(internal_token: str | None) -> dict[str, str]:
    """The headers every call to an internal service carries."""
    return {} if internal_token is None else {"Authorization": f"Bearer {internal_token}"}


class Upstream:
    """Calls to one dependency named `name` (it names the dependency in every error; URLs
    appear only in the log)."""

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
        total_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """The 2xx response; raises a Dependency*Error otherwise. A call that never reached
        the dependency is retried; an idempotent one also on 502/503 and on a connection that
        broke; a read timeout never (the same wait would repeat). Retries included, the call
        takes at most `total_timeout_s`."""
        try:
            async with asyncio.timeout(total_timeout_s):
                return await self._with_retries(
                    method, url, request_id, timeout, idempotent, kwargs
                )
        except TimeoutError:
            self.on_error(self.name, "timeout")
            log.warning("%s %s %s: no answer within %s s", self.name, method, url, total_timeout_s)
            reason = f"no answer within {total_timeout_s} s"
            raise DependencyTimeoutError(self.name, reason) from None

    async def _with_retries(
        self,
        method: str,
        url: str,
        request_id: str,
        timeout: httpx.Timeout,
        idempotent: bool,
        kwargs: dict[str, Any],
    ) -> httpx.Response:
        headers = {**kwargs.pop("headers", {}), REQUEST_ID_HEADER: request_id}
        for attempt in range(1 + self.retries):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = await self.client.request(
                    method, url, headers=headers, timeout=timeout, **kwargs
                )
            except httpx.TimeoutException as exc:
                if not isinstance(exc, httpx.ConnectTimeout):
                    raise self.timed_out(method, url, exc) from exc
                error: Exception = self.unavailable(method, url, exc)
                retryable = True
            except httpx.TransportError as exc:
                error = self.unavailable(method, url, exc)
                retryable = isinstance(exc, NOT_SENT) or idempotent
            else:
                if response.status_code not in RETRYABLE_STATUS:
                    return self.check(response)
                error = self.status_error(response)
                retryable = idempotent
            if not retryable or attempt == self.retries:
                raise error
            log.warning("%s %s %s failed (%s); retrying", self.name, method, url, error)
        raise AssertionError("the loop returns or raises")

    def timed_out(self, method: str, url: str, exc: Exception) -> DependencyTimeoutError:
        self.on_error(self.name, "timeout")
        log.warning("%s %s %s: %s", self.name, method, url, type(exc).__name__)
        return DependencyTimeoutError(self.name, type(exc).__name__)

    def unavailable(self, method: str, url: str, exc: Exception) -> DependencyUnavailableError:
        self.on_error(self.name, "unavailable")
        log.warning("%s %s %s: %s: %s", self.name, method, url, type(exc).__name__, exc)
        return DependencyUnavailableError(self.name, type(exc).__name__)

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
        if status in (401, 403):
            # The gateway's own credentials (internal_token) were refused: not the client's fault.
            self.on_error(self.name, "failed")
            log.error("%s refused the gateway's internal token (HTTP %d)", self.name, status)
            return DependencyFailedError(self.name, "refused the gateway's credentials")
        if status < 500:
            self.on_error(self.name, "rejected")
            return DependencyRejectedError(self.name, status, detail)
        self.on_error(self.name, "failed")
        log.warning("%s answered HTTP %d: %s", self.name, status, detail)
        return DependencyFailedError(self.name, f"HTTP {status}")
