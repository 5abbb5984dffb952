"""Helpers of the gateway tests: a service process on a fixed port that can be stopped and
restarted, SSE and Prometheus parsing. (Imported as tests.gateway.gateway_testutil.)"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

DOCUMENTS = {
    "rivers": "The Zorblax river flows through the city of Quendor. Its water glows blue at "
    "night because of small fish. Fishermen of Quendor sell the fish at the morning market.",
    "mountains": "The Vantir mountains lie north of Quendor and carry snow all year. Travelers "
    "cross them by the old Kessa pass, which is closed in the winter months.",
    "orchards": "Orchards of the Melbrook valley grow silver pears. The harvest festival of "
    "Melbrook is held in the ninth month, with music and pear cakes for every guest.",
}


def wait_precomputed(client: httpx.Client, doc_id: str, timeout_s: float = 120.0) -> dict:
    """The document once its precompute status is no longer pending."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        document = client.get(f"/v1/documents/{doc_id}").json()
        if document["precompute"]["status"] != "pending":
            return document
        time.sleep(0.2)
    raise AssertionError(f"{doc_id} still pending after {timeout_s} s")


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event, data) of each frame; asserts every frame is well formed."""
    frames = []
    assert text.endswith("\n\n"), "the stream ends with a blank line"
    for block in text.strip("\n").split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            name, sep, value = line.partition(": ")
            assert sep, f"malformed SSE line {line!r}"
            if name == "event":
                event = value
            else:
                assert name == "data", f"unexpected SSE field {name!r}"
                data.append(value)
        assert data, f"frame without data: {block!r}"
        frames.append((event, "\n".join(data)))
    return frames


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples `name` whose labels include `labels` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@contextmanager
def frozen(*services) -> Iterator[None]:
    """The services' processes stopped with SIGSTOP (the kernel still accepts connections, but
    nothing answers: a hung dependency), resumed with SIGCONT at the end."""
    for service in services:
        service.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for service in services:
            service.proc.send_signal(signal.SIGCONT)


def timed(call) -> tuple[httpx.Response, float]:
    """The response of `call()` and the seconds it took."""
    start = time.monotonic()
    response = call()
    return response, time.monotonic() - start


# The query of `ask`; a query routed like it must retrieve the same chunk set.
QUERY = {"question": "What is there?", "top_k": 2, "max_tokens": 2}


def ask(http: httpx.Client, doc_ids: list[str], **extra) -> httpx.Response:
    """A short query restricted to `doc_ids`."""
    return http.post("/v1/query", json={**QUERY, "doc_ids": doc_ids, **extra})


def routed(http: httpx.Client) -> tuple[int, list[str]]:
    """(index of the engine in the gateway's pool, doc_ids) of a query's route. Rendezvous
    weights hash the engines' URLs, whose ports differ from run to run, so tests pick their
    victim by the route rather than a route by the victim: three documents make only seven
    chunk sets, and all of them miss a given engine of three in one run out of seventeen."""
    doc_ids = list(DOCUMENTS)[:2]
    answer = ask(http, doc_ids)
    assert answer.status_code == 200, answer.text
    name = answer.json()["engine"]
    assert name.startswith("engine-"), name
    return int(name.removeprefix("engine-")), doc_ids
