"""OpenAI-compatible routes: /v1/chat/completions (the conversation, retrieval over its last two
user turns), /v1/completions (over the prompt) and /v1/models, whose second model id serves the
model without retrieval (the prompt as sent); streams end with `data: [DONE]`."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from common.contract import Mode, TokenLogprob
from common.sse import sse
from gateway.api.conversation import Conversation, conversation
from gateway.api.deps import ApiKeyDep, PipelineDep, SettingsDep, key_name
from gateway.api.rag import check_response_format, rag_request
from gateway.api.responses import GENERATION_ERRORS, KEYED
from gateway.api.schemas.logprobs import ChatLogprobs, CompletionLogprobs
from gateway.api.schemas.openai import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIUsage,
    RagInfo,
)
from gateway.api.schemas.query import SourceOut
from gateway.api.streaming import (
    SSE_HEADERS,
    collect_unless_disconnected,
    open_generation,
)
from gateway.auth import ApiKey
from gateway.errors import GatewayDependencyError
from gateway.pipeline import Pipeline, TimedStream
from gateway.settings import GatewaySettings
from gateway.types import EngineResult

router = APIRouter(tags=["openai"])
log = logging.getLogger(__name__)
STARTED_AT = int(time.time())
FINISH_REASONS = {"stop", "length"}

# (text delta, finish_reason, the logprobs of the delta's tokens) -> chunk
ChunkOf = Callable[[str | None, str | None, list[TokenLogprob] | None], dict]
PromptChunkOf = Callable[[list[TokenLogprob]], dict]  # the prompt's logprobs -> its echo chunk


@router.get("/v1/models", response_model=ModelList, responses=KEYED)
async def models(settings: SettingsDep) -> ModelList:
    return ModelList(
        data=[
            ModelCard(id=settings.model_name, created=STARTED_AT),
            ModelCard(id=settings.no_rag_model, created=STARTED_AT),
        ]
    )


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_ERRORS
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    pipeline: PipelineDep,
    settings: SettingsDep,
    key: ApiKeyDep,
):
    chat = conversation(body.messages)
    if chat is None:
        raise HTTPException(422, detail="messages: no user message with text to answer")
    run = await _start(
        pipeline,
        body,
        chat.question,
        chat.system,
        request,
        settings,
        key,
        chat,
        logprobs=body.logprob_count,
        # The no-rag id searches nothing; the RAG id as its `rag.retrieval` says.
        **({"retrieve": False} if body.model == settings.no_rag_model else {}),
    )
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"

    def chunk(
        text: str | None, finish_reason: str | None, entries: list[TokenLogprob] | None
    ) -> dict:
        delta = {} if text is None else {"content": text}
        logprobs = None if entries is None else ChatLogprobs.of(entries).model_dump()
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": run.created,
            "model": run.model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            ],
        }

    if body.stream:
        first = chunk("", None, None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return run.streaming_response(chunk, first, body.include_usage)
    outcome = await run.collect(request)
    return ChatCompletionResponse(
        id=completion_id,
        created=run.created,
        model=run.model,
        choices=[
            ChatChoice(
                message={"role": "assistant", "content": outcome.text},
                finish_reason=_finish(outcome),
                logprobs=None if outcome.logprobs is None else ChatLogprobs.of(outcome.logprobs),
            )
        ],
        usage=OpenAIUsage.of(outcome.usage),
        rag=run.rag_info(outcome),
    )


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_ERRORS)
async def completions(
    body: CompletionRequest,
    request: Request,
    pipeline: PipelineDep,
    settings: SettingsDep,
    key: ApiKeyDep,
):
    prompt = body.single_prompt()
    if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
        raise HTTPException(422, detail="prompt: exactly one non-blank prompt is supported")
    no_rag = body.model == settings.no_rag_model
    if not no_rag and (body.echo or isinstance(prompt, tuple)):
        asked = "echo" if body.echo else "a prompt of token ids"
        raise HTTPException(
            400,
            detail=f"{asked} needs model {settings.no_rag_model!r} (the prompt as sent, "
            "without retrieval)",
        )
    fields: dict[str, Any] = {"logprobs": body.logprobs}
    if no_rag:
        # Every position computed: what echo's prompt logprobs need, and a raw prompt reuses
        # no cache anyway (engine/blend/layout.py).
        fields.update(
            retrieve=False,
            raw_prompt=True,
            mode=Mode.FULL_PREFILL,
            prompt_token_ids=prompt if isinstance(prompt, tuple) else None,
            prompt_logprobs=(body.logprobs or 0) if body.echo else None,
        )
    text_prompt = prompt if isinstance(prompt, str) else None
    run = await _start(pipeline, body, text_prompt or "", None, request, settings, key, **fields)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    offset = 0  # where the next streamed token starts in the choice's text

    def chunk(
        text: str | None, finish_reason: str | None, entries: list[TokenLogprob] | None
    ) -> dict:
        nonlocal offset
        logprobs = None
        if entries is not None and body.logprobs is not None:
            logprobs = CompletionLogprobs.of(entries, offset).model_dump()
            offset += sum(len(e.token) for e in entries)
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": run.created,
            "model": run.model,
            "choices": [
                {
                    "index": 0,
                    "text": text or "",
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ],
        }

    def echo_chunk(entries: list[TokenLogprob]) -> dict:
        return chunk(_echo_text(text_prompt, entries), None, entries)

    if body.stream:
        echo = echo_chunk if body.echo else None
        return run.streaming_response(chunk, None, body.include_usage, echo)
    outcome = await run.collect(request)
    prompt_entries = (outcome.prompt_logprobs or []) if body.echo else []
    echoed = _echo_text(text_prompt, prompt_entries) if body.echo else ""
    entries = prompt_entries + (outcome.logprobs or [])
    return CompletionResponse(
        id=completion_id,
        created=run.created,
        model=run.model,
        choices=[
            CompletionChoice(
                text=echoed + outcome.text,
                finish_reason=_finish(outcome),
                logprobs=None if body.logprobs is None else CompletionLogprobs.of(entries),
            )
        ],
        usage=OpenAIUsage.of(outcome.usage),
        rag=run.rag_info(outcome),
    )


def _echo_text(text_prompt: str | None, entries: list[TokenLogprob]) -> str:
    """The prompt as echoed: its text as sent, or its tokens' texts (a prompt of token ids)."""
    return text_prompt if text_prompt is not None else "".join(e.token for e in entries)


async def _start(
    pipeline: Pipeline,
    body: ChatCompletionRequest | CompletionRequest,
    question: str,
    system: str | None,
    request: Request,
    settings: GatewaySettings,
    key: ApiKey | None,
    chat: Conversation | None = None,
    **fields: Any,
) -> _Run:
    """Start the generation; `fields` replace those of the RagRequest the body gives
    (retrieval off, a raw prompt, logprobs)."""
    unsupported = body.unsupported()
    if unsupported:
        raise HTTPException(
            400,
            detail=f"not supported: {', '.join(unsupported)} (docs/gateway.md lists the "
            "fields ragblend supports; user, metadata and store are ignored)",
        )
    await check_response_format(body.response_format)
    rag = rag_request(
        question,
        system,
        body.rag,
        body,
        max_tokens=body.token_limit,
        stop=body.stop_list,
        settings=settings,
        key=key,
        max_model_len=pipeline.engines.max_model_len,
        history=chat.history if chat else (),
        left_out_turns=chat.left_out_turns if chat else 0,
    )
    rag = replace(rag, **fields)
    log.info(
        "%s top_k=%d collections=%s key=%s",
        request.url.path,
        rag.top_k,
        rag.collections,
        key_name(key),
    )
    stream, stack = await open_generation(pipeline, rag, request)
    return _Run(stream, stack, body.model or settings.model_name)


class _Run:
    """One open generation of an OpenAI route, answered as JSON or as a chunk stream."""

    def __init__(self, stream: TimedStream, stack: AsyncExitStack, model: str):
        self.stream, self.stack, self.model = stream, stack, model
        self.generation = stream.generation
        self.created = int(time.time())

    def rag_info(self, outcome: EngineResult) -> RagInfo:
        timings = outcome.timings.model_dump(exclude={"layers"})
        return RagInfo(
            sources=[SourceOut.of(s) for s in self.generation.used_sources(outcome.dropped_chunks)],
            dropped_sources=outcome.dropped_chunks,
            dropped_turns=outcome.dropped_turns + self.generation.rag.left_out_turns,
            collections=self.generation.rag.collections,
            mode=self.generation.mode,
            recomputed_tokens=outcome.usage.recomputed_tokens,
            engine=outcome.engine,
            timings={**timings, "gateway_ttft_s": self.stream.ttft_s},
        )

    async def collect(self, request: Request) -> EngineResult:
        async with self.stack:
            outcome = await collect_unless_disconnected(self.stream, request)
        if outcome is None:
            raise HTTPException(499, detail="client disconnected")
        return outcome

    def streaming_response(
        self,
        chunk: ChunkOf,
        first: dict | None,
        include_usage: bool,
        echo: PromptChunkOf | None = None,
    ) -> StreamingResponse:
        return StreamingResponse(
            self._chunks(chunk, first, include_usage, echo),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, "X-RAGBlend-Engine": self.stream.engine},
            background=BackgroundTask(self.stack.aclose),
        )

    async def _chunks(
        self, chunk: ChunkOf, first: dict | None, include_usage: bool, echo: PromptChunkOf | None
    ) -> AsyncIterator[str]:
        def framed(payload: dict) -> str:
            if include_usage:  # OpenAI sends "usage": null on every chunk but the last
                payload.setdefault("usage", None)
            return sse(payload)

        async with self.stack:
            if first is not None:
                yield framed(first)
            try:
                async for event in self.stream.events():
                    if isinstance(event, EngineResult):
                        finish = chunk(None, _finish(event), None)
                        finish["rag"] = self.rag_info(event).model_dump()  # sources, drops
                        yield framed(finish)
                        if include_usage:
                            last = chunk(None, None, None)
                            last["choices"] = []
                            last["usage"] = OpenAIUsage.of(event.usage).model_dump()
                            yield sse(last)
                    elif event.prompt_logprobs is not None:
                        if echo is not None:  # sent before the first token
                            yield framed(echo(event.prompt_logprobs))
                    elif event.text or event.logprobs is not None:
                        entries = None if event.logprobs is None else [event.logprobs]
                        yield framed(chunk(event.text, None, entries))
            except GatewayDependencyError as exc:
                log.warning("stream failed: %s", exc)
                yield sse({"error": {"message": str(exc), "type": "upstream_error"}})
            yield "data: [DONE]\n\n"


def _finish(outcome: EngineResult) -> str:
    return outcome.finish_reason if outcome.finish_reason in FINISH_REASONS else "stop"
