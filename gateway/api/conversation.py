"""An OpenAI chat's messages as the engine takes a conversation: the system text, the earlier
turns (user and assistant alternating) and the last user message as the question."""

from __future__ import annotations

from dataclasses import dataclass

from common.contract import TurnIn
from gateway.api.schemas.openai import ChatMessage

TURN_JOINER = "\n\n"


@dataclass(frozen=True)
class Conversation:
    question: str
    system: str | None
    history: tuple[TurnIn, ...]
    # Assistant messages before the first user message (a greeting): no user turn to follow,
    # so not sent; counted in `rag.dropped_turns`.
    left_out_turns: int


def conversation(messages: list[ChatMessage]) -> Conversation | None:
    """The conversation of `messages`, None without a user message with text. Messages after
    the last user message, tool messages and empty ones are not sent; consecutive messages of
    one role are joined (templates want user and assistant alternating), so unanswered user
    messages before the last one join the question."""
    system = "\n".join(m.text for m in messages if m.role in ("system", "developer"))
    said = [m for m in messages if m.role in ("user", "assistant") and m.text.strip()]
    last_user = max((i for i, m in enumerate(said) if m.role == "user"), default=None)
    if last_user is None:
        return None
    runs: list[tuple[str, list[str]]] = []  # (role, texts) of consecutive messages
    for message in said[: last_user + 1]:
        if runs and runs[-1][0] == message.role:
            runs[-1][1].append(message.text)
        else:
            runs.append((message.role, [message.text]))
    left_out = len(runs[0][1]) if runs[0][0] == "assistant" else 0
    if left_out:
        runs = runs[1:]
    *earlier, (_, asked) = runs
    history = tuple(TurnIn(role=role, text=TURN_JOINER.join(texts)) for role, texts in earlier)
    return Conversation(TURN_JOINER.join(asked), system or None, history, left_out)
