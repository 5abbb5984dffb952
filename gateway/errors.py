"""Named failures of the gateway's dependencies, raised by the clients and turned into HTTP
statuses only in the routes."""

from __future__ import annotations


class GatewayDependencyError(RuntimeError):
    """Base of the failures of a dependency; `dependency` names it."""

    dependency: str


class DependencyUnavailableError(GatewayDependencyError):
    """A dependency did not answer (down, unreachable or timed out): a 503 naming it."""

    def __init__(self, dependency: str, reason: str):
        super().__init__(f"{dependency} unavailable: {reason}")
        self.dependency = dependency
        self.reason = reason


class DependencyBusyError(GatewayDependencyError):
    """A dependency answered 429: passed on with its Retry-After."""

    def __init__(self, dependency: str, detail: str, retry_after_s: str):
        super().__init__(f"{dependency} busy: {detail}")
        self.dependency = dependency
        self.detail = detail
        self.retry_after_s = retry_after_s


class DependencyRejectedError(GatewayDependencyError):
    """A dependency refused the request (4xx other than 429), e.g. a prompt too long for the
    model or an unknown document; the status and its detail are passed on."""

    def __init__(self, dependency: str, status_code: int, detail: str):
        super().__init__(f"{dependency} rejected the request ({status_code}): {detail}")
        self.dependency = dependency
        self.status_code = status_code
        self.detail = detail


class DependencyFailedError(GatewayDependencyError):
    """A dependency answered with a 5xx or broke off a stream: a 502 naming it."""

    def __init__(self, dependency: str, detail: str):
        super().__init__(f"{dependency} failed: {detail}")
        self.dependency = dependency
        self.detail = detail


class DependencyTimeoutError(GatewayDependencyError):
    """A dependency did not answer within the time the gateway gives it: a 504 naming it
    (not retried: the same wait would only repeat)."""

    def __init__(self, dependency: str, reason: str):
        super().__init__(f"{dependency} timed out: {reason}")
        self.dependency = dependency
        self.reason = reason


def http_status(exc: GatewayDependencyError) -> int:
    """The status a client gets for `exc` (the exception handlers of gateway.api.handlers;
    a rejection that is not passed on is a 502)."""
    if isinstance(exc, DependencyUnavailableError):
        return 503
    if isinstance(exc, DependencyBusyError):
        return 429
    if isinstance(exc, DependencyTimeoutError):
        return 504
    if isinstance(exc, DependencyRejectedError) and exc.status_code in (400, 404, 413, 415, 422):
        return exc.status_code
    return 502
