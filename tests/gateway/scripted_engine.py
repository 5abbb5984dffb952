"""A stand-in engine process for the gateway's failover tests: the engine's /health and
streamed /v1/generate, with the statuses, delays and queue estimates a real engine cannot be
made to give, and
(with --record) a JSON line per generate body received, to show what the gateway sent."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pydantic import ValidationError

from common.contract import (
    AUTO_RATIO,
    QUEUE_ESTIMATE_HEADER,
    Blend,
    GenerateBody,
    GenerateResponse,
    Selection,
    Timings,
    Usage,
)
from tests.service_process import REPO_ROOT, free_port, service_env, wait_ready

# "slow 2.5" in a question: its first event comes 2.5 s after the request (with --slow-questions).
SLOW = re.compile(r"slow (\d+(?:\.\d+)?)")
# "queued 2.5": the response headers at once, announcing a queue wait of 0, and the first event
# 2.5 s later (with --slow-questions): an engine whose estimate fell short.
QUEUED = re.compile(r"queued (\d+(?:\.\d+)?)")
DELTA_INTERVAL_S = 0.1
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 1 << 20


def handler_class(args: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *log_args) -> None:  # noqa: A002
            sys.stderr.write(format % log_args + "\n")

        def do_GET(self) -> None:
            if self.path != "/health":
                self._json(404, {"detail": "not found"})
                return
            self._json(
                200,
                {
                    "status": "ok",
                    "max_model_len": MAX_MODEL_LEN,
                    "queue_estimate_s": 0.0,
                    "prefill_tokens_per_s": args.prefill_tokens_per_s,
                },
            )

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            if self.path != "/v1/generate" or not 0 < length <= MAX_BODY_BYTES:
                self._json(404, {"detail": "not found"})
                return
            # The contract's body: a gateway that sent another shape fails the test with a 422.
            try:
                body = GenerateBody.model_validate_json(self.rfile.read(length))
            except ValidationError as exc:
                self._json(422, {"detail": str(exc)})
                return
            if args.record:
                with open(args.record, "a", encoding="utf-8") as record:
                    record.write(body.model_dump_json() + "\n")
            if args.generate_status == 429:
                self._json(429, {"detail": "engine busy: queue full"}, {"Retry-After": "2"})
                return
            if args.generate_status != 200:
                self._json(args.generate_status, {"detail": "an internal error"})
                return
            slow = SLOW.search(body.question)
            if slow and args.slow_questions:
                time.sleep(float(slow.group(1)))
            queued = QUEUED.search(body.question) if args.slow_questions else None
            self._stream(body, float(queued.group(1)) if queued else None)

        def _stream(self, body: GenerateBody, queued_s: float | None) -> None:
            max_tokens = body.max_tokens
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                if queued_s is not None:
                    self.send_header(QUEUE_ESTIMATE_HEADER, "0")
                self.end_headers()
                if queued_s is not None:
                    time.sleep(queued_s)
                for _ in range(max_tokens):
                    self._event("delta", {"text": " word"})
                    time.sleep(DELTA_INTERVAL_S)
                self._event("result", _result(body).model_dump())
            except (BrokenPipeError, ConnectionResetError):
                pass  # the gateway closed the stream: the generation is cancelled
            self.close_connection = True

        def _event(self, name: str, payload: dict) -> None:
            self.wfile.write(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _result(body: GenerateBody) -> GenerateResponse:
    """A result as the engine reports it: the selection and who chose the ratio as asked."""
    max_tokens = body.max_tokens
    auto = body.recompute_ratio == AUTO_RATIO
    timings = dict.fromkeys(Timings.model_fields.keys() - {"layers"}, 0.0)
    return GenerateResponse(
        text=" word" * max_tokens,
        finish_reason="length",
        usage=Usage(
            prompt_tokens=10, completion_tokens=max_tokens, cached_tokens=0, recomputed_tokens=0
        ),
        timings=Timings(**timings, layers=[]),
        blend=Blend(
            recompute_ratio=0.15,
            leading_layers=1,
            chosen_by="auto" if auto else "request",
            fell_back_to_full_prefill=False,
            selection=(body.selection or Selection.HKVD).value,
        ),
        chunk_tiers=[],
        dropped_chunks=0,
        dropped_turns=0,
    )


@dataclass
class ScriptedEngine:
    """The stand-in as a process on a 127.0.0.1 port (`url`, like a tests Service)."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def start(log_path: Path, *args: str, port: int | None = None) -> ScriptedEngine:
    port = port or free_port()
    cmd = [sys.executable, "-m", "tests.gateway.scripted_engine", "--port", str(port), *args]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=service_env()
        )
    engine = ScriptedEngine(proc, port, log_path)
    if not wait_ready(proc, f"{engine.url}/health", 30):
        engine.stop()
        raise AssertionError(f"the scripted engine did not start:\n{log_path.read_text()}")
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--generate-status", type=int, default=200, help="200, 429, 500…")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None)
    parser.add_argument(
        "--slow-questions", action="store_true", help="honour 'slow N' and 'queued N' markers"
    )
    parser.add_argument("--record", default=None, help="append each generate body to this file")
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), handler_class(args)).serve_forever()


if __name__ == "__main__":
    main()
