"""The real process while a maximum-size document is being embedded: /health still answers
(the work runs off the event loop), and SIGTERM ends the process within a bounded time."""

from __future__ import annotations

import signal
import threading
import time

import httpx

MAX_DOCUMENT_CHARS = 60_000
# Exactly the limit: ~600 chunks of 32 tokens, embedded one at a time so that the ingest takes
# seconds however fast the machine (a fast one embedded 300 chunks in batches of 32 before
# the checks ran), while the work in flight when SIGTERM comes stays one chunk.
MAX_DOC = "\n\n".join(
    f"Ledger entry {i}: the granary at Holmfjord stored {i * 17 % 1000} sacks of barley."
    for i in range(1000)
)[:MAX_DOCUMENT_CHARS]
EXIT_WITHIN_S = 15.0


def test_health_answers_during_a_large_ingest_and_sigterm_exits_in_bounded_time(
    spawn_retriever, tmp_path
):
    service = spawn_retriever(
        tmp_path / "data",
        "--chunk-tokens",
        "32",
        "--embed-batch-size",
        "1",
        "--max-document-chars",
        str(MAX_DOCUMENT_CHARS),
    )
    outcome: dict[str, object] = {}

    def post_max_size() -> None:
        try:
            with service.client(timeout_s=300) as http:
                outcome["response"] = http.post("/v1/documents", json={"text": MAX_DOC})
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    poster = threading.Thread(target=post_max_size)
    poster.start()
    time.sleep(1.0)  # chunking done, embedding under way
    with service.client(timeout_s=2.0) as http:
        for _ in range(3):
            assert http.get("/health").status_code == 200
            time.sleep(0.2)
    assert "response" not in outcome, "the ingest finished before the checks: make it larger"
    assert len(MAX_DOC) == MAX_DOCUMENT_CHARS

    started = time.monotonic()
    service.proc.send_signal(signal.SIGTERM)
    code = service.proc.wait(timeout=EXIT_WITHIN_S + 30)
    elapsed_s = time.monotonic() - started
    poster.join(timeout=30)
    assert elapsed_s < EXIT_WITHIN_S, f"exited {elapsed_s:.1f} s after SIGTERM"
    assert code in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in service.log()
