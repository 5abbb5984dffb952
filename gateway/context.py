"""The request id of the request being served, for log lines anywhere on its path."""

from __future__ import annotations

import logging
from contextvars import ContextVar

request_id_var: ContextVar[str] = ContextVar("ragblend_request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record, so a log format may print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True
