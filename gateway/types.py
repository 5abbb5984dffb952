"""The request path's types, independent of the gateway's HTTP schemas: a RAG request as a
route resolved it, what is asked of the engine over the sources found, and its result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.contract import (
    MAX_QUESTION_CHARS,
    ChunkIn,
    ChunkOrder,
    GenerateBody,
    GenerateResponse,
    Mode,
    ResponseFormat,
    RetrievalName,
    SearchRequest,
    Selection,
    TurnIn,
)


@dataclass(frozen=True)
class Source:
    chunk_id: str
    doc_id: str
    score: float
    text: str
    collection: str  # "" for a passage the request brought
    cache_salt: str = ""  # the scope of its KV (gateway/tenancy.py)


@dataclass(frozen=True)
class RequestPassage:
    """A passage the request brought (doc_id: the id it gave, else passage-<index>)."""

    doc_id: str
    text: str


@dataclass(frozen=True)
class RagRequest:
    """One request of a generating route, its defaults resolved: what to retrieve for
    `question` (the search), and how to generate over what is found (the rest)."""

    question: str
    top_k: int
    doc_ids: list[str] | None = None
    collections: list[str] | None = None  # None: every collection
    retrieval: RetrievalName | None = None  # None: the retriever's default
    hops: int = 1
    system: str | None = None
    # The conversation before the question (user and assistant alternating), and the turns
    # the route could not send (rag.dropped_turns counts them with the engine's).
    history: tuple[TurnIn, ...] = ()
    left_out_turns: int = 0
    mode: Mode = Mode.CACHEBLEND
    # None: the engine's settings; max_recompute_ratio bounds recompute_ratio "auto" only.
    recompute_ratio: float | Literal["auto"] | None = None
    max_recompute_ratio: float | None = None
    selection: Selection | None = None
    max_tokens: int = 128
    temperature: float | None = None  # None: the engine's default
    top_p: float | None = None
    seed: int | None = None
    # None: the engine's default (its presence_penalty, frequency_penalty, repetition_penalty).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    chunk_order: ChunkOrder = ChunkOrder.BEST_FIRST  # the prompt's; sources stay best first
    # The prompt as sent, no template or system text: `question`, or these token ids.
    raw_prompt: bool = False
    prompt_token_ids: tuple[int, ...] | None = None
    # Top alternatives of each generated token's log-probability, and of each prompt token's
    # (None: not asked).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None  # None: free text

    def retrieval_query(self) -> str:
        """The question, and in a conversation the user turn before it too: a follow-up ("and
        its timeout?") names its subject there. The question first, so that what a retriever
        truncates is the earlier turn."""
        users = [turn.text for turn in self.history if turn.role == "user"]
        query = f"{self.question}\n{users[-1]}" if users else self.question
        return query[:MAX_QUESTION_CHARS]

    # The request's own passages, blended before what the search finds; retrieve: False with
    # retrieval "none" and for the no-rag model id of the OpenAI routes (no search).
    passages: tuple[RequestPassage, ...] = ()
    retrieve: bool = True
    # The salt of its passages and prompt prefix, and whether a retrieved chunk takes its
    # collection's (gateway/tenancy.py).
    cache_salt: str = ""
    collection_salts: bool = False

    def search(self) -> SearchRequest:
        return SearchRequest(
            query=self.retrieval_query(),
            top_k=self.top_k,
            doc_ids=self.doc_ids,
            collections=self.collections,
            retrieval=self.retrieval,
            hops=self.hops,
        )


@dataclass(frozen=True)
class EngineRequest:
    """A RAG request over the sources retrieved for it, best first."""

    rag: RagRequest
    sources: tuple[Source, ...]

    @property
    def mode(self) -> Mode:
        return self.rag.mode

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

    def engine_body(self) -> GenerateBody:
        """The engine's /v1/generate body, always streamed: the gateway needs the first token's
        time and must notice a dropped client while the engine is still working. The engine
        drops the oldest turns and chunks from the end (the worst) until the prompt fits
        (fit_context)."""
        rag = self.rag
        return GenerateBody(
            system=rag.system,
            chunks=[
                ChunkIn(id=s.chunk_id, text=s.text, cache_salt=s.cache_salt)
                for s in self.unique_sources()
            ],
            question=rag.question,
            history=list(rag.history),
            mode=rag.mode,
            recompute_ratio=rag.recompute_ratio,
            max_recompute_ratio=rag.max_recompute_ratio,
            selection=rag.selection,
            max_tokens=rag.max_tokens,
            temperature=rag.temperature,
            top_p=rag.top_p,
            seed=rag.seed,
            presence_penalty=rag.presence_penalty,
            frequency_penalty=rag.frequency_penalty,
            repetition_penalty=rag.repetition_penalty,
            stop=list(rag.stop) or None,
            stream=True,
            fit_context=True,
            chunk_order=rag.chunk_order,
            raw_prompt=rag.raw_prompt,
            prompt_token_ids=None if rag.prompt_token_ids is None else list(rag.prompt_token_ids),
            logprobs=rag.logprobs,
            prompt_logprobs=rag.prompt_logprobs,
            response_format=rag.response_format,
            cache_salt=rag.cache_salt,
        )


class EngineResult(GenerateResponse):
    """The engine's result, plus which engine served it (by name, "engine-0"…)."""

    engine: str
