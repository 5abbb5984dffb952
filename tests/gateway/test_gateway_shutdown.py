"""SIGTERM drains: a stream in flight still gets its result, new connections are refused."""

from __future__ import annotations

import json
import signal

import httpx
import pytest


def test_sigterm_lets_an_open_stream_finish_before_the_gateway_exits(
    spawn_gateway, engine, documents
):
    gateway = spawn_gateway(engine)
    with (
        httpx.Client(base_url=gateway.url, timeout=120) as http,
        http.stream(
            "POST",
            "/v1/query",
            json={"question": "Kessa pass?", "max_tokens": 40, "stream": True},
        ) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line == "event: delta")
        gateway.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    result = [line for line in rest if line.startswith("data: ")][-1]
    assert json.loads(result[6:])["usage"]["completion_tokens"] >= 1
    assert "event: result" in rest
    gateway.proc.wait(timeout=30)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway.url}/health", timeout=2)
