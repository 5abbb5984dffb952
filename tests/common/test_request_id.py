"""The request id: a caller's X-Request-ID kept (bounded, printable) or a new one made, echoed
in the response and printed in every log line written while the request is served."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from common.request_id import RequestIdFilter, RequestIdMiddleware, request_id_var

LOGGER = "tests.common.request_id"


class Recorder(logging.Handler):
    """The request id of every record it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RequestIdFilter())
        self.ids: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.ids.append(record.request_id)  # type: ignore[attr-defined]


@pytest.fixture
def recorder():
    logger = logging.getLogger(LOGGER)
    handler = Recorder()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)


def client() -> TestClient:
    app = FastAPI()
    app.add_middleware(RequestIdMiddleware)

    @app.get("/work")
    async def work() -> dict:
        logging.getLogger(LOGGER).info("working")
        return {"id": request_id_var.get()}

    return TestClient(app)


def test_the_callers_id_is_echoed_and_in_the_log_lines_of_its_request(recorder):
    response = client().get("/work", headers={"X-Request-ID": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert response.json() == {"id": "abc-123"}
    assert recorder.ids == ["abc-123"]


def test_without_an_id_each_request_gets_a_new_one(recorder):
    service = client()
    first, second = (service.get("/work").headers["x-request-id"] for _ in range(2))
    assert first != second and len(first) == 32 and int(first, 16) >= 0
    assert recorder.ids == [first, second]


@pytest.mark.parametrize(("given", "kept"), [("x" * 500, "x" * 128), ("  spaced  ", "spaced")])
def test_a_callers_id_is_stripped_and_bounded(given, kept):
    assert client().get("/work", headers={"X-Request-ID": given}).headers["x-request-id"] == kept


@pytest.mark.parametrize("given", ["tab\there", "   "])
def test_an_unprintable_or_blank_id_is_replaced(given):
    echoed = client().get("/work", headers={"X-Request-ID": given}).headers["x-request-id"]
    assert echoed != given.strip() and len(echoed) == 32


async def test_the_id_is_set_for_the_request_only():
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(request_id_var.get())
        await send({"type": "http.response.start", "status": 204, "headers": []})

    async def send(message) -> None:
        seen.append(dict(message["headers"])[b"x-request-id"].decode())

    scope = {"type": "http", "headers": [(b"x-request-id", b"abc-123")]}
    await RequestIdMiddleware(app)(scope, None, send)
    assert seen == ["abc-123", "abc-123"] and request_id_var.get() == "-"


def test_configured_logging_prints_the_id_and_keeps_httpx_quiet():
    script = (
        "import logging; from common.request_id import configure_logging, request_id_var\n"
        "configure_logging('info'); request_id_var.set('rid-7')\n"
        "logging.getLogger('svc').info('hello'); logging.getLogger('httpx').info('noise')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stderr.endswith(" INFO svc [rid-7]: hello\n") and "noise" not in done.stderr
