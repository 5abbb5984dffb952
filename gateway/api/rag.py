"""The RagRequest of a generating route's body: its defaults filled in from the settings and
the API key, and the limits that are settings checked (422, or 403 for a collection); a
response_format's JSON schema checked to compile (400) before anything is retrieved."""

from __future__ import annotations

import asyncio

from fastapi import HTTPException

from common.contract import (
    MAX_PASSAGE_CHARS,
    MAX_PASSAGES,
    NO_RETRIEVAL,
    ChunkOrder,
    ResponseFormat,
    TurnIn,
)
from common.json_grammar import SchemaError, check_grammar, json_grammar
from gateway.api.deps import query_collections, resolve_max_tokens, resolve_top_k
from gateway.api.schemas.openai import ChatCompletionRequest, CompletionRequest, RagOptions
from gateway.api.schemas.query import QueryRequest
from gateway.auth import ApiKey
from gateway.settings import GatewaySettings
from gateway.tenancy import CacheScope
from gateway.types import RagRequest, RequestPassage


def rag_request(
    question: str,
    system: str | None,
    options: QueryRequest | RagOptions,
    sampling: QueryRequest | ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    stop: tuple[str, ...],
    settings: GatewaySettings,
    key: ApiKey | None,
    max_model_len: int | None,
    history: tuple[TurnIn, ...] = (),
    left_out_turns: int = 0,
) -> RagRequest:
    """`options`: what to retrieve and how to blend (the /v1/query body, or an OpenAI body's
    `rag`); `sampling`: the body's sampling fields; `history`: a chat's earlier turns. A
    question in LMCache's convention (the passage_separator setting) brings its system prompt
    and passages, and searches only when `options.retrieval` names a search."""
    top_k = resolve_top_k(options.top_k, settings)
    resolved_max_tokens = resolve_max_tokens(max_tokens, settings, max_model_len)
    passages = [
        RequestPassage(p.id or f"passage-{i}", p.text)
        for i, p in enumerate(options.documents or ())
    ]
    retrieval = options.retrieval
    split = split_prompt(question, settings.passage_separator)
    if split is not None:
        split_system, texts, question = split
        system = split_system or system
        first = len(passages)
        passages += [RequestPassage(f"passage-{first + i}", t) for i, t in enumerate(texts)]
        retrieval = retrieval or NO_RETRIEVAL
        _check_split_passages(passages)
    scope = CacheScope(settings.cache_sharing, settings.keyed)
    return RagRequest(
        question=question,
        top_k=top_k,
        doc_ids=options.doc_ids,
        collections=query_collections(options.collections, key),
        retrieval=None if retrieval == NO_RETRIEVAL else retrieval,
        passages=tuple(passages),
        retrieve=retrieval != NO_RETRIEVAL,
        cache_salt=scope.request_salt(key, sampling.cache_salt),
        collection_salts=scope.scoped,
        hops=options.hops or settings.default_hops,
        system=system,
        history=history,
        left_out_turns=left_out_turns,
        mode=options.mode,
        recompute_ratio=options.recompute_ratio,
        max_recompute_ratio=options.max_recompute_ratio,
        selection=options.selection,
        max_tokens=resolved_max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        stop=stop,
        chunk_order=options.chunk_order or ChunkOrder(settings.chunk_order),
        response_format=sampling.response_format,
    )


async def check_response_format(response_format: ResponseFormat | None) -> None:
    """A 400 naming what the grammar library rejects in the response_format's JSON schema
    (the engine compiles it again against its tokenizer); checked on a thread, as a large
    schema takes milliseconds."""
    schema = None if response_format is None else response_format.schema_text()
    if schema is None:
        return
    try:
        await asyncio.to_thread(lambda: check_grammar(json_grammar(schema)))
    except SchemaError as exc:
        raise HTTPException(400, detail=f"response_format: the JSON schema: {exc}") from exc


def query_rag_request(
    body: QueryRequest,
    *,
    settings: GatewaySettings,
    key: ApiKey | None,
    max_model_len: int | None,
) -> RagRequest:
    """The RagRequest of a /v1/query body: it carries both the options and the sampling."""
    return rag_request(
        body.question,
        None,
        body,
        body,
        max_tokens=body.max_tokens,
        stop=tuple(body.stop or ()),
        settings=settings,
        key=key,
        max_model_len=max_model_len,
        history=tuple(TurnIn(role=turn.role, text=turn.text) for turn in body.history),
    )


def split_prompt(text: str, separator: str | None) -> tuple[str | None, list[str], str] | None:
    """LMCache's convention for its blending: the system prompt, the passages and the question
    joined by a separator string. (system prompt or None, passages, question) of a text that
    holds `separator`; None when it holds none (or no separator is set), or only blanks after
    the last one. Blank parts are left out."""
    if not separator or separator not in text:
        return None
    first, *middle, last = text.split(separator)
    if not last.strip():
        return None
    return (first if first.strip() else None), [m for m in middle if m.strip()], last


def _check_split_passages(passages: list[RequestPassage]) -> None:
    """The limits of documents, for passages split from a prompt too (a 422 naming them)."""
    if len(passages) > MAX_PASSAGES:
        raise HTTPException(
            422, detail=f"prompt: {len(passages)} passages, more than {MAX_PASSAGES}"
        )
    for passage in passages:
        if len(passage.text) > MAX_PASSAGE_CHARS:
            raise HTTPException(
                422,
                detail=f"prompt: passage {passage.doc_id} has more than {MAX_PASSAGE_CHARS} "
                "characters",
            )
