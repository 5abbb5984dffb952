"""Requests served by a real engine in a set order: one decoding while the others arrive."""

from __future__ import annotations

import asyncio

from engine.engine import Engine
from engine.types import GenerateRequest, GenerateResult


def while_first_decodes(
    engine: Engine, first: GenerateRequest, later: list[GenerateRequest]
) -> list[list[int]]:
    """`first` starts alone; once its first token is out, `later` arrive together. Every
    request's token ids, in that order."""

    async def run(req: GenerateRequest, started: asyncio.Event | None = None):
        ids: list[int] = []
        async for event in engine.start(req):
            if started is not None:
                started.set()
            if isinstance(event, GenerateResult):
                ids = event.token_ids
        return ids

    async def together() -> list[list[int]]:
        started = asyncio.Event()
        head = asyncio.create_task(run(first, started))
        await started.wait()
        rest = await asyncio.gather(*(run(r) for r in later))
        return [await head, *rest]

    return asyncio.run(together())
