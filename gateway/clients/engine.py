"""Client of the engine pool: a background poller of each engine's health, streamed generation
on the healthy engine chosen by rendezvous hashing of the chunk ids (failing over to the next
one before a first event arrives, by the rules of gateway.failover), precompute per engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from common.contract import Delta, GenerateBody, PrecomputeRequest, PrecomputeResponse
from gateway.clients.upstream import NOT_SENT, REQUEST_ID_HEADER, Upstream, detail_of
from gateway.errors import (
    DependencyBusyError,
    DependencyFailedError,
    DependencyTimeoutError,
    DependencyUnavailableError,
    GatewayDependencyError,
)
from gateway.failover import (
    Miss,
    after_miss,
    announced_queue_estimate_s,
    final_status,
    first_event_deadline_s,
    miss_of_status,
    soonest_retry_after_s,
)
from gateway.routing import rank_engines
from gateway.types import EngineRequest, EngineResult

log = logging.getLogger(__name__)
POLLER_REQUEST_ID = "health-poller"


@dataclass
class EngineState:
    """What the poller knows of one engine; clients see only its `name`."""

    name: str
    url: str
    healthy: bool = True  # until a probe says otherwise: a new gateway tries every engine
    max_model_len: int | None = None
    queue_estimate_s: float = 0.0
    # Its measured prefill speed (None before it measured one).
    prefill_tokens_per_s: float | None = None
    # When an event of any of its streams last arrived (time.monotonic): a sign of life.
    last_event_at: float = float("-inf")
    # The engine reads and writes a KV tier all engines share: one precompute serves them all.
    shared_kv: bool = False
    # Why it is down (an exception's class name or an HTTP status: never an address).
    reason: str | None = None
    changed_at: float = field(default_factory=time.monotonic)

    def mark(self, healthy: bool, reason: str | None = None) -> None:
        if healthy != self.healthy:
            state = "healthy" if healthy else f"down: {reason}"
            log.warning("%s (%s) is %s", self.name, self.url, state)
            self.changed_at = time.monotonic()
        self.healthy, self.reason = healthy, None if healthy else reason

    def state(self) -> dict:
        """What /ready shows of it."""
        return {
            "state": "up" if self.healthy else "down",
            "reason": self.reason,
            "for_s": round(time.monotonic() - self.changed_at, 1),
            "shared_kv": self.shared_kv,
            "queue_estimate_s": self.queue_estimate_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
        }


class EngineStream:
    """The engine's SSE answer: Delta per `event: delta`, one EngineResult from `event: result`.
    `first_event` waits for the first one, which `events` then yields again."""

    def __init__(self, engine: EngineState, response: httpx.Response, upstream: Upstream):
        self.engine = engine
        self.response = response
        self.upstream = upstream
        self._events = self._parse()
        self._first: Delta | EngineResult | None = None

    async def first_event(self) -> Delta | EngineResult:
        self._first = await anext(self._events)
        return self._first

    async def events(self) -> AsyncIterator[Delta | EngineResult]:
        if self._first is not None:
            yield self._first
        async for event in self._events:
            yield event

    async def _parse(self) -> AsyncIterator[Delta | EngineResult]:
        event, data = "message", []
        try:
            async for line in self.response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif not line and data:
                    self.engine.last_event_at = time.monotonic()
                    payload = json.loads("\n".join(data))
                    if event == "delta":
                        yield Delta.model_validate(payload)
                    elif event == "result":
                        yield self._outcome(payload)
                        return
                    elif event == "error":
                        log.warning("%s (%s): %s", self.engine.name, self.engine.url, payload)
                        raise self._failed("its generation failed")
                    event, data = "message", []
        except (httpx.TransportError, json.JSONDecodeError, ValidationError) as exc:
            log.warning("%s (%s) stream: %r", self.engine.name, self.engine.url, exc)
            raise self._failed(f"stream broke off ({type(exc).__name__})") from exc
        raise self._failed("stream ended without a result")

    def _failed(self, detail: str) -> DependencyFailedError:
        self.upstream.on_error(self.upstream.name, "failed")
        return DependencyFailedError(self.engine.name, detail)

    def _outcome(self, payload: dict) -> EngineResult:
        return EngineResult.model_validate({**payload, "engine": self.engine.name})


class _Skipped(Exception):
    """One engine missed the request before its first event: it may go to the next one.
    `counted`: the miss is already in the upstream error metric."""

    def __init__(
        self, miss: Miss, reason: str, *, retry_after_s: str | None = None, counted: bool = False
    ):
        super().__init__(reason)
        self.miss = miss
        self.retry_after_s = retry_after_s
        self.counted = counted


class EnginePool:
    def __init__(
        self,
        upstream: Upstream,
        urls: list[str],
        *,
        connect_timeout_s: float,
        generate_timeout_s: float,
        precompute_timeout_s: float,
        ttft_timeout_s: float,
        health_interval_s: float,
        health_timeout_s: float,
    ):
        self.upstream = upstream
        self.engines = [EngineState(f"engine-{i}", url) for i, url in enumerate(urls)]
        self._by_url = {e.url: e for e in self.engines}
        self.generate_timeout = httpx.Timeout(generate_timeout_s, connect=connect_timeout_s)
        self.precompute_timeout = httpx.Timeout(precompute_timeout_s, connect=connect_timeout_s)
        self.ttft_timeout_s = ttft_timeout_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self._poller: asyncio.Task | None = None

    @property
    def max_model_len(self) -> int | None:
        """The smallest context any engine reported (a request may land on any), or None."""
        known = [e.max_model_len for e in self.engines if e.max_model_len is not None]
        return min(known) if known else None

    def candidates(self, chunk_ids: list[str]) -> list[EngineState]:
        """The healthy engines, preferred first; every engine when none is known healthy (the
        poller may not have seen one come back yet)."""
        ranked = [self._by_url[url] for url in rank_engines(list(self._by_url), chunk_ids)]
        return [e for e in ranked if e.healthy] or ranked

    @asynccontextmanager
    async def generate(
        self, generation: EngineRequest, *, request_id: str
    ) -> AsyncIterator[EngineStream]:
        """An engine stream whose first event has arrived. The engines are tried in rendezvous
        order; what an engine's miss (unreachable, 503, 429, 5xx, a broken stream, no first
        event by its deadline) means is gateway.failover's `after_miss`: in short, an engine
        that never started on the request (unreachable, 503, 429) costs nothing and the next
        one is tried, while a second engine that took the request and missed ends the
        attempts; the client then gets `final_status`'s error naming every engine tried. A 422
        (or another 4xx) is raised as is: the request would fare no better elsewhere. Leaving
        the context closes the connection, which cancels the engine's work."""
        misses: list[tuple[str, _Skipped]] = []
        retried = False
        for engine in self.candidates(generation.chunk_ids):
            waiting_since = time.monotonic()
            try:
                stream = await self._open(engine, generation, request_id)
            except _Skipped as skipped:
                if not skipped.counted:
                    self.upstream.on_error(self.upstream.name, skipped.miss.metric_kind)
                misses.append((engine.name, skipped))
                verdict = after_miss(
                    skipped.miss,
                    streaming_others=engine.last_event_at > waiting_since,
                    retried=retried,
                )
                if verdict.mark_down:
                    engine.mark(False, _down_reason(skipped))
                retried = verdict.retried
                if not verdict.try_next:
                    log.warning(
                        "%s (%s): %s; retried once already", engine.name, engine.url, skipped
                    )
                    break
                log.warning("%s (%s): %s; failing over", engine.name, engine.url, skipped)
                continue
            try:
                yield stream
            finally:
                await stream.response.aclose()
            return
        raise _none_answered(misses)

    async def _open(
        self, engine: EngineState, generation: EngineRequest, request_id: str
    ) -> EngineStream:
        body = generation.engine_body()
        request = self.upstream.client.build_request(
            "POST",
            f"{engine.url}/v1/generate",
            json=body.model_dump(mode="json"),
            headers={REQUEST_ID_HEADER: request_id},
            timeout=self.generate_timeout,
        )

        def deadline_s(queue_estimate_s: float) -> float:
            return first_event_deadline_s(
                self.ttft_timeout_s,
                queue_estimate_s,
                _prompt_bytes(body),
                engine.max_model_len,
                engine.prefill_tokens_per_s,
            )

        limit_s = deadline_s(engine.queue_estimate_s)
        started = time.monotonic()
        response: httpx.Response | None = None
        opened = False
        try:
            async with asyncio.timeout(limit_s):
                response = await self.upstream.client.send(request, stream=True)
                miss = miss_of_status(response.status_code)
                if miss is Miss.NOT_READY:
                    raise _Skipped(miss, "HTTP 503")
                if not response.is_success:
                    await response.aread()
                if miss is Miss.FAILED:
                    log.warning(
                        "%s (%s) answered HTTP %d: %s",
                        engine.name,
                        engine.url,
                        response.status_code,
                        detail_of(response),
                    )
                    raise _Skipped(miss, f"HTTP {response.status_code}")
                if miss is Miss.BUSY:
                    retry_after_s = response.headers.get("Retry-After", "1")
                    raise _Skipped(miss, detail_of(response), retry_after_s=retry_after_s)
                if not response.is_success:
                    self.upstream.check(response)
            window_s = limit_s - (time.monotonic() - started)
            if (estimate := announced_queue_estimate_s(response.headers)) is not None:
                # The wait the engine announced as it queued the request, where the polled
                # estimate is up to a health interval old: in a burst, far too short.
                window_s = deadline_s(estimate)
            stream = EngineStream(engine, response, self.upstream)
            await self._first_event(stream, window_s)
            opened = True
            return stream
        except TimeoutError:
            waited_s = time.monotonic() - started
            raise _Skipped(Miss.SLOW, f"no first event within {waited_s:.1f} s") from None
        except NOT_SENT as exc:
            raise _Skipped(Miss.UNREACHABLE, type(exc).__name__) from exc
        except httpx.TransportError as exc:
            raise _Skipped(Miss.FAILED, f"{type(exc).__name__} before its answer") from exc
        except DependencyFailedError as exc:
            raise _Skipped(Miss.FAILED, exc.detail, counted=True) from exc
        finally:
            if not opened and response is not None:
                await response.aclose()

    async def _first_event(self, stream: EngineStream, window_s: float) -> None:
        """The stream's first event within `window_s`, then within another `ttft_timeout_s`
        for as long as each window saw the engine deliver events of other streams: it took
        the request and works through its queue, so the request keeps its place there (an
        estimate that fell short is no hung engine). TimeoutError after a silent window."""
        first = asyncio.ensure_future(stream.first_event())
        try:
            since = time.monotonic()
            while not (await asyncio.wait({first}, timeout=max(window_s, 0.0)))[0]:
                if stream.engine.last_event_at <= since:
                    raise TimeoutError
                since, window_s = time.monotonic(), self.ttft_timeout_s
            first.result()
        finally:
            first.cancel()

    async def precompute(
        self, engine: EngineState, body: PrecomputeRequest, *, request_id: str
    ) -> PrecomputeResponse:
        """Store the chunks' KV on one engine; idempotent (stored chunks are skipped)."""
        response = await self.upstream.request(
            "POST",
            f"{engine.url}/v1/precompute",
            json=body.model_dump(mode="json"),
            request_id=request_id,
            timeout=self.precompute_timeout,
            idempotent=True,
        )
        return PrecomputeResponse.model_validate(response.json())

    async def poll(self, engine: EngineState) -> None:
        """One short /health probe; a probe that fails or is late marks the engine unhealthy."""
        body: dict = {}
        try:
            async with asyncio.timeout(self.health_timeout_s):
                response = await self.upstream.client.get(
                    f"{engine.url}/health",
                    headers={REQUEST_ID_HEADER: POLLER_REQUEST_ID},
                    timeout=httpx.Timeout(self.health_timeout_s),
                )
            healthy = response.status_code == 200
            if healthy:
                body = response.json()
        except (TimeoutError, httpx.HTTPError, ValueError) as exc:
            healthy, reason = False, type(exc).__name__
        else:
            reason = f"HTTP {response.status_code}"
        engine.mark(healthy, reason)
        if healthy:
            max_model_len = body.get("max_model_len")
            engine.max_model_len = max_model_len if isinstance(max_model_len, int) else None
            estimate = body.get("queue_estimate_s")
            engine.queue_estimate_s = float(estimate) if isinstance(estimate, int | float) else 0.0
            speed = body.get("prefill_tokens_per_s")
            valid = isinstance(speed, int | float) and speed > 0
            engine.prefill_tokens_per_s = float(speed) if valid else None
            engine.shared_kv = body.get("shared_kv") is True

    @property
    def shared_kv(self) -> bool:
        """Every healthy engine (every engine when none is known healthy) shares one KV
        tier, so a chunk precomputed on one of them is found by all."""
        healthy = [e for e in self.engines if e.healthy] or self.engines
        return all(e.shared_kv for e in healthy)

    async def poll_all(self) -> int:
        """Probe every engine concurrently; the number healthy."""
        await asyncio.gather(*(self.poll(e) for e in self.engines))
        return sum(e.healthy for e in self.engines)

    async def start(self) -> None:
        """A first round of probes (at most health_timeout_s), then the background poller."""
        await self.poll_all()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.poll_all()


def _prompt_bytes(body: GenerateBody) -> int:
    """UTF-8 bytes of every text the engine's prompt is made of."""
    return sum(len(text.encode()) for _, text in body.texts())


def _down_reason(skipped: _Skipped) -> str:
    """Why /ready shows the engine down (never an address)."""
    return "no first event in time" if skipped.miss is Miss.SLOW else str(skipped)


def _none_answered(misses: list[tuple[str, _Skipped]]) -> GatewayDependencyError:
    """The error of a request no engine answered, naming each engine tried and its miss."""
    tried = "; ".join(f"{name}: {skipped}" for name, skipped in misses)
    status = final_status([skipped.miss for _, skipped in misses])
    if status == 504:
        return DependencyTimeoutError("engine", f"no engine answered in time ({tried})")
    if status == 429:
        retry_after_s = soonest_retry_after_s([s.retry_after_s for _, s in misses])
        return DependencyBusyError("engine", f"every engine is busy ({tried})", retry_after_s)
    if status == 503:
        return DependencyUnavailableError("engine", f"no engine answered ({tried})")
    return DependencyFailedError("engine", f"every engine failed ({tried})")
