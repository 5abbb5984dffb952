"""Plain dataclasses of the request path, independent of HTTP schemas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Where the best chunk goes in the prompt: first, or last (next to the question).
ChunkOrderName = Literal["best_first", "best_last"]


@dataclass(frozen=True)
class Source:
    chunk_id: str
    doc_id: str
    score: float
    text: str
    collection: str | None = None  # None from a retriever older than collections


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
    # None: the engine's default (its presence_penalty, frequency_penalty, repetition_penalty).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    system: str | None = None
    chunk_order: ChunkOrderName = "best_first"  # the prompt's; sources stay best first

    @property
    def chunk_ids(self) -> list[str]:
        return [s.chunk_id for s in self.sources]

    def unique_sources(self) -> list[Source]:
        """The sources as the engine gets them, best first, each chunk once (the same chunk
        twice would only cost positions)."""
        seen: set[str] = set()
        unique = []
        for source in self.sources:
            if source.chunk_id not in seen:
                seen.add(source.chunk_id)
                unique.append(source)
        return unique

    def used_sources(self, dropped_chunks: int) -> list[Source]:
        """The sources the engine kept after dropping `dropped_chunks` from the end to fit."""
        unique = self.unique_sources()
        return unique[: len(unique) - dropped_chunks]

    def engine_body(self, *, fit_context: bool) -> dict[str, Any]:
        """The engine's /v1/generate body, always streamed: the gateway needs the first token's
        time and must notice a dropped client while the engine is still working. With
        `fit_context` the engine drops chunks from the end (the worst) until the prompt fits."""
        chunks = [{"id": s.chunk_id, "text": s.text} for s in self.unique_sources()]
        body: dict[str, Any] = {
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
        # Sent only when set: engines older than the penalties forbid the fields.
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if fit_context:
            body["fit_context"] = True
        if self.chunk_order != "best_first":  # engines older than chunk_order forbid the field
            body["chunk_order"] = self.chunk_order
        return body


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass
class EngineResult:
    """The engine's final result event, plus which engine served it (by name, "engine-0"…)."""

    text: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, Any]
    blend: dict[str, Any]
    engine: str
    chunk_tiers: list[str | None] = field(default_factory=list)
    dropped_chunks: int = 0  # chunks left out (from the end) so that the prompt fit
