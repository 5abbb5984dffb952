"""Fixtures of the gateway tests: real retriever, engine and gateway processes
(`python -m ragblend ...`) on free loopback ports over the tiny model of tests/conftest.py, and
a few ingested documents whose chunks are precomputed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.gateway_testutil import DOCUMENTS, wait_precomputed
from tests.service_process import Service, free_port

# Short chunks counted in the engine's own tokens, so top_k of them fit its 1024 positions.
CHUNK_TOKENS = "48"

Spawn = Callable[..., Service]


class Services:
    """Starts services (`services(name, *args, port=None, env=None)`) and keeps them, in start
    order, to stop."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.started: list[Service] = []

    def __call__(
        self, name: str, *args: str, port: int | None = None, env: dict[str, str] | None = None
    ) -> Service:
        port = port or free_port()
        log = self.logs / f"{name}-{port}.log"
        service = Service(name, list(args), log, port, env=env or {})
        self.started.append(service)
        return service.start()

    def stop_from(self, first: int) -> None:
        """Stop every service started since the first `first`, the latest first."""
        for service in reversed(self.started[first:]):
            service.stop()
        del self.started[first:]


@pytest.fixture(scope="session")
def services(tmp_path_factory) -> Iterator[Services]:
    """spawn(name, *args, port=None, env=None): a started service; all stopped at the end."""
    spawn = Services(tmp_path_factory.mktemp("service-logs"))
    yield spawn
    spawn.stop_from(0)


@pytest.fixture(autouse=True)
def stop_the_services_a_test_started(services: Services) -> Iterator[None]:
    """What a test or its function fixtures spawn stops when it ends: each service holds a model
    or an index in memory, and `make test` runs two workers on one machine. Session and module
    fixtures, set up before it, keep theirs."""
    first = len(services.started)
    yield
    services.stop_from(first)


@pytest.fixture(scope="session")
def spawn_retriever(services: Spawn, tiny_model: str, tmp_path_factory) -> Spawn:
    """A retriever with its own empty index."""

    def spawn(*args: str) -> Service:
        data = tmp_path_factory.mktemp("retriever")
        return services(
            "retriever",
            "--data-dir",
            str(data),
            "--tokenizer",
            tiny_model,
            "--chunk-tokens",
            CHUNK_TOKENS,
            *args,
        )

    return spawn


@pytest.fixture(scope="session")
def retriever(spawn_retriever: Spawn) -> Service:
    return spawn_retriever()


@pytest.fixture(scope="session")
def spawn_engine(services: Spawn, tiny_model: str, tmp_path_factory) -> Spawn:
    """An engine of the tiny model with its own KV folder; queue depth 1 so that two
    generations saturate it."""

    def spawn(*args: str, port: int | None = None, env: dict[str, str] | None = None) -> Service:
        store = tmp_path_factory.mktemp("kv")
        return services(
            "engine",
            "--model",
            tiny_model,
            "--store-path",
            str(store),
            "--queue-depth",
            "1",
            # One sequence at a time: the limit tests fill the pool and the queue with two.
            "--max-num-seqs",
            "1",
            # A fixed ratio: these tests pin the gateway, the controller has its own tests.
            "--recompute-ratio",
            "0.15",
            *args,
            port=port,
            env=env,
        )

    return spawn


@pytest.fixture(scope="session")
def engine(spawn_engine: Spawn) -> Service:
    return spawn_engine()


@pytest.fixture(scope="session")
def spawn_gateway(services: Spawn, retriever: Service) -> Spawn:
    def spawn(*engines: Service, args: tuple[str, ...] = ()) -> Service:
        urls = ",".join(e.url for e in engines)
        return services(
            "gateway",
            "--retriever-url",
            retriever.url,
            "--engine-urls",
            urls,
            "--default-top-k",
            "2",
            "--default-max-tokens",
            "4",
            # The test CPUs are shared: a long question's search may take seconds.
            "--retrieval-timeout-s",
            "30",
            *args,
        )

    return spawn


@pytest.fixture(scope="session")
def gateway(spawn_gateway: Spawn, engine: Service) -> Service:
    return spawn_gateway(engine)


@pytest.fixture(scope="session")
def documents(gateway: Service) -> dict[str, list[str]]:
    """doc_id -> chunk ids of the sample documents, ingested and precomputed."""
    with httpx.Client(base_url=gateway.url, timeout=120.0) as client:
        chunks = {}
        for doc_id, text in DOCUMENTS.items():
            response = client.post("/v1/documents", json={"text": text, "id": doc_id})
            assert response.status_code == 200, response.text
            chunks[doc_id] = response.json()["chunk_ids"]
        for doc_id in DOCUMENTS:
            assert wait_precomputed(client, doc_id)["precompute"]["status"] == "ready"
    return chunks


@pytest.fixture
def client(gateway: Service, documents) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=120.0) as http:
        yield http
