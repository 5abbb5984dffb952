"""Plain dataclasses of the request path, independent of HTTP schemas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Source:
    chunk_id: str
    doc_id: str
    score: float
    text: str


@dataclass(frozen=True)
class EngineRequest:
    """What the gateway asks the engine for; `question` is the user's text, the chunks come
    from retrieval."""

    question: str
    sources: tuple[Source, ...]
    mode: str = "cacheblend"
    recompute_ratio: float | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    system: str | None = None

    @property
    def chunk_ids(self) -> list[str]:
        return [s.chunk_id for s in self.sources]

    def engine_body(self) -> dict[str, Any]:
        """The engine's /v1/generate body, always streamed: the gateway needs the first token's
        time and must notice a dropped client while the engine is still working."""
        seen: set[str] = set()
        chunks = []
        for source in self.sources:
            if source.chunk_id not in seen:  # the same chunk twice would only cost positions
                seen.add(source.chunk_id)
                chunks.append({"id": source.chunk_id, "text": source.text})
        return {
            "system": self.system,
            "chunks": chunks,
            "question": self.question,
            "mode": self.mode,
            "recompute_ratio": self.recompute_ratio,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop) or None,
            "stream": True,
        }


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass
class EngineResult:
    """The engine's final result event, plus which engine served it."""

    text: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, Any]
    blend: dict[str, Any]
    engine_url: str
    chunk_tiers: list[str | None] = field(default_factory=list)
