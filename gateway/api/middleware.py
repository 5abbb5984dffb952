"""Pure ASGI middleware around every request: the X-Request-ID, admission control (429 when
max_concurrency queries are in flight), request metrics and the access log, all measured until
the last byte of a streamed answer, which BaseHTTPMiddleware could not do."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import send_error
from common.request_id import HEADER, request_id_of, request_id_var
from common.serving import is_quiet_probe
from gateway.metrics import GatewayMetrics

# The routes that occupy an engine: only these count against max_concurrency.
ADMITTED_PATHS = frozenset({"/v1/query", "/v1/chat/completions", "/v1/completions"})
# One line per request once its last byte is sent (uvicorn's own access log, written when the
# status goes out, is off: a stream that breaks off later would stay logged as a 200).
access_log = logging.getLogger("gateway.access")


class Admission:
    """A counter of query requests in flight; never waits: when full, the caller gets 429."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    def try_enter(self) -> bool:
        # The event loop is single-threaded, so check-and-increment cannot race.
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        assert self.in_flight > 0
        self.in_flight -= 1


class GatewayMiddleware:
    def __init__(
        self, app: ASGIApp, *, metrics: GatewayMetrics, admission: Admission, retry_after_s: int
    ):
        self.app = app
        self.metrics = metrics
        self.admission = admission
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_of(scope)
        token = request_id_var.set(request_id)
        state = scope.setdefault("state", {})
        state["request_id"], state["arrived_at"] = request_id, started
        status = 500  # unless a response starts: the app failed before answering

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (HEADER, request_id.encode())]
            await send(message)

        admitted = scope["method"] == "POST" and scope["path"] in ADMITTED_PATHS
        try:
            if admitted and not self.admission.try_enter():
                self.metrics.rejected.inc()
                await self._too_busy(send_with_id)
                return
            if admitted:
                self.metrics.in_flight.inc()
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                if admitted:
                    self.admission.leave()
                    self.metrics.in_flight.dec()
        finally:
            # A stream that failed after its 200 went out counts as the failure it was.
            status = state.get("outcome_status", status)
            label = _route_label(scope, admitted)
            elapsed_s = time.perf_counter() - started
            self.metrics.requests.labels(label, scope["method"], str(status)).inc()
            self.metrics.request_seconds.labels(label, scope["method"], str(status)).observe(
                elapsed_s
            )
            _log_access(scope, status, elapsed_s)
            request_id_var.reset(token)

    async def _too_busy(self, send: Send) -> None:
        detail = f"gateway busy: {self.admission.limit} queries in flight (max_concurrency)"
        await send_error(send, 429, detail, [(b"retry-after", str(self.retry_after_s).encode())])


def _route_label(scope: Scope, admitted: bool) -> str:
    """The route's template (bounded label values); a refused query never reached routing."""
    route = scope.get("route")
    if route is not None:
        return route.path
    return scope["path"] if admitted else "unmatched"


def _log_access(scope: Scope, status: int, elapsed_s: float) -> None:
    client = scope.get("client")
    address = f"{client[0]}:{client[1]}" if client else "-"
    query = scope.get("query_string", b"").decode("latin-1")
    path = f"{scope['path']}?{query}" if query else scope["path"]
    # A successful probe is counted in the metrics like any request, but logged at DEBUG only.
    level = logging.DEBUG if is_quiet_probe(scope["path"], status) else logging.INFO
    access_log.log(level, '%s "%s %s" %d %.3fs', address, scope["method"], path, status, elapsed_s)
