"""The `logprobs` of OpenAI's responses, in its two shapes: a chat choice's list of tokens with
their top alternatives, and a completion choice's parallel lists (tokens, token_logprobs,
top_logprobs, text_offset), built from the engine's per-token log-probabilities."""

from __future__ import annotations

from pydantic import BaseModel, Field

from common.contract import TokenLogprob


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes")


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None

    @classmethod
    def of(cls, entries: list[TokenLogprob]) -> ChatLogprobs:
        return cls(content=[_chat_entry(e) for e in entries])


def _chat_entry(entry: TokenLogprob) -> ChatTokenLogprob:
    assert entry.logprob is not None, "a generated token always has a log-probability"
    return ChatTokenLogprob(
        token=entry.token,
        logprob=entry.logprob,
        bytes=list(entry.token.encode()),
        top_logprobs=[
            ChatTopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
            for t in entry.top_logprobs
        ],
    )


class CompletionLogprobs(BaseModel):
    """One item per token in each list; a prompt's first token (echo) has null in
    token_logprobs and top_logprobs, as OpenAI and vLLM give it."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int] = Field(description="where each token starts in the choice's text")

    @classmethod
    def of(cls, entries: list[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
        """The logprobs of `entries`, the first of which starts at `offset` in the text."""
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return cls(
            tokens=[e.token for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[_top(e) for e in entries],
            text_offset=offsets,
        )


def _top(entry: TokenLogprob) -> dict[str, float] | None:
    """The token itself and its top alternatives by text (vLLM's shape: the chosen token is
    listed even when it is not among the top)."""
    if entry.logprob is None:
        return None
    top = {t.token: t.logprob for t in entry.top_logprobs}
    top.setdefault(entry.token, entry.logprob)
    return top
