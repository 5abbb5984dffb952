"""Client of the engine pool: streamed generation on the engine chosen by rendezvous hashing
of the chunk ids (failing over down the ranking), precompute and health per engine."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from gateway.clients.upstream import REQUEST_ID_HEADER, Upstream
from gateway.errors import (
    DependencyFailedError,
    DependencyUnavailableError,
    GatewayDependencyError,
)
from gateway.routing import rank_engines
from gateway.types import Delta, EngineRequest, EngineResult

log = logging.getLogger(__name__)


class EngineStream:
    """The engine's SSE answer: Delta per `event: delta`, one EngineResult from `event: result`."""

    def __init__(self, url: str, response: httpx.Response, upstream: Upstream):
        self.url = url
        self.response = response
        self.upstream = upstream

    async def events(self) -> AsyncIterator[Delta | EngineResult]:
        event, data = "message", []
        try:
            async for line in self.response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif not line and data:
                    payload = json.loads("\n".join(data))
                    if event == "delta":
                        yield Delta(payload["text"])
                    elif event == "result":
                        yield self._outcome(payload)
                        return
                    elif event == "error":
                        self.upstream.on_error(self.upstream.name, "failed")
                        raise DependencyFailedError(
                            f"engine {self.url}", str(payload.get("detail"))
                        )
                    event, data = "message", []
        except (httpx.TransportError, json.JSONDecodeError) as exc:
            self.upstream.on_error(self.upstream.name, "failed")
            raise DependencyFailedError(f"engine {self.url}", f"stream broke off: {exc}") from exc
        self.upstream.on_error(self.upstream.name, "failed")
        raise DependencyFailedError(f"engine {self.url}", "stream ended without a result")

    def _outcome(self, payload: dict) -> EngineResult:
        return EngineResult(
            text=payload["text"],
            finish_reason=payload["finish_reason"],
            usage=payload["usage"],
            timings=payload["timings"],
            blend=payload["blend"],
            engine_url=self.url,
            chunk_tiers=payload.get("chunk_tiers", []),
        )


class EnginePool:
    def __init__(
        self,
        upstream: Upstream,
        urls: list[str],
        *,
        connect_timeout_s: float,
        generate_timeout_s: float,
        precompute_timeout_s: float,
    ):
        self.upstream = upstream
        self.urls = urls
        self.generate_timeout = httpx.Timeout(generate_timeout_s, connect=connect_timeout_s)
        self.precompute_timeout = httpx.Timeout(precompute_timeout_s, connect=connect_timeout_s)
        self.health_timeout = httpx.Timeout(5.0, connect=connect_timeout_s)

    @asynccontextmanager
    async def generate(
        self, generation: EngineRequest, *, request_id: str
    ) -> AsyncIterator[EngineStream]:
        """Open a streamed generation on the first engine of the ranking that is up. A 429 or
        422 of that engine is raised as is: the request reached it, so it is not re-sent.
        Closing the stream early closes the connection, which cancels the engine's work."""
        body = generation.engine_body()
        failures = []
        for url in rank_engines(self.urls, generation.chunk_ids):
            request = self.upstream.client.build_request(
                "POST",
                f"{url}/v1/generate",
                json=body,
                headers={REQUEST_ID_HEADER: request_id},
                timeout=self.generate_timeout,
            )
            try:
                response = await self.upstream.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Not connected, so nothing was sent: safe to send to the next engine.
                self.upstream.on_error(self.upstream.name, "unavailable")
                failures.append(f"{url}: {type(exc).__name__}")
                log.warning("engine %s is down (%s); failing over", url, exc)
                continue
            except httpx.TransportError as exc:
                self.upstream.on_error(self.upstream.name, "unavailable")
                raise DependencyUnavailableError(
                    "engine", f"{url}: {type(exc).__name__} before its answer began"
                ) from exc
            if response.status_code == 503:  # up but its model is not loaded yet
                await response.aclose()
                self.upstream.on_error(self.upstream.name, "unavailable")
                failures.append(f"{url}: HTTP 503")
                continue
            try:
                if not response.is_success:
                    await response.aread()
                    self.upstream.check(response)
                yield EngineStream(url, response, self.upstream)
            finally:
                await response.aclose()
            return
        tried = "; ".join(failures)
        raise DependencyUnavailableError("engine", f"no engine answered ({tried})")

    async def precompute(self, url: str, chunks: list[dict], *, request_id: str) -> dict:
        """Store the chunks' KV on one engine; idempotent (stored chunks are skipped)."""
        response = await self.upstream.request(
            "POST",
            f"{url}/v1/precompute",
            json={"chunks": chunks},
            request_id=request_id,
            timeout=self.precompute_timeout,
            idempotent=True,
        )
        return response.json()

    async def health(self, url: str, *, request_id: str) -> dict:
        response = await self.upstream.request(
            "GET",
            f"{url}/health",
            request_id=request_id,
            timeout=self.health_timeout,
            idempotent=False,
        )
        return response.json()

    async def healthy_urls(self, *, request_id: str) -> list[str]:
        """URLs of the engines whose /health answers 200, probed concurrently."""

        async def probe(url: str) -> str | None:
            try:
                await self.health(url, request_id=request_id)
            except GatewayDependencyError:
                return None
            return url

        return [url for url in await asyncio.gather(*map(probe, self.urls)) if url]
