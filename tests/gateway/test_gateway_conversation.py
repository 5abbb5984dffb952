"""An OpenAI chat as the engine gets it: the earlier turns alternating user and assistant, the
last user message the question, and a retrieval query that carries the user turn before it."""

from __future__ import annotations

from common.contract import MAX_QUESTION_CHARS, TurnIn
from gateway.api.conversation import conversation
from gateway.api.schemas.openai import ChatMessage
from gateway.types import RagRequest


def messages(*said: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=text) for role, text in said]  # type: ignore[arg-type]


def test_a_single_question_has_no_history():
    chat = conversation(messages(("system", "Be brief."), ("user", "Where is Kessa?")))
    assert chat is not None
    assert (chat.question, chat.system, chat.history, chat.left_out_turns) == (
        "Where is Kessa?",
        "Be brief.",
        (),
        0,
    )


def test_earlier_turns_are_sent_in_order_and_the_last_user_message_is_the_question():
    chat = conversation(
        messages(
            ("system", "Be brief."),
            ("user", "Where is Kessa?"),
            ("assistant", "North of Quendor."),
            ("developer", "No lists."),
            ("user", "And when is it closed?"),
            ("assistant", "an unfinished answer after the question is not sent"),
        )
    )
    assert chat is not None
    assert chat.question == "And when is it closed?" and chat.system == "Be brief.\nNo lists."
    assert chat.history == (
        TurnIn(role="user", text="Where is Kessa?"),
        TurnIn(role="assistant", text="North of Quendor."),
    )


def test_runs_of_one_role_are_joined_and_a_leading_greeting_is_counted_as_left_out():
    chat = conversation(
        messages(
            ("assistant", "Hello! Ask me anything."),
            ("user", "Where is Kessa?"),
            ("user", "The pass, I mean."),
            ("assistant", "North of Quendor."),
            ("tool", "ignored"),
            ("assistant", "It crosses the Vantir mountains."),
            ("user", "  "),
            ("user", "Is it open now?"),
            ("user", "In winter?"),
        )
    )
    assert chat is not None and chat.left_out_turns == 1
    assert [(t.role, t.text) for t in chat.history] == [
        ("user", "Where is Kessa?\n\nThe pass, I mean."),
        ("assistant", "North of Quendor.\n\nIt crosses the Vantir mountains."),
    ]
    assert chat.question == "Is it open now?\n\nIn winter?"


def test_a_chat_without_a_user_message_with_text_has_no_conversation():
    assert conversation(messages(("system", "Be brief."), ("user", " "))) is None


def test_the_retrieval_query_of_a_follow_up_adds_the_user_turn_before_it():
    history = (
        TurnIn(role="user", text="Where is Kessa?"),
        TurnIn(role="assistant", text="North of Quendor."),
        TurnIn(role="user", text="Which mountains?"),
        TurnIn(role="assistant", text="The Vantir mountains."),
    )
    follow_up = RagRequest(question="And when is it closed?", top_k=2, history=history)
    assert follow_up.search().query == "And when is it closed?\nWhich mountains?"
    assert RagRequest(question="Why?", top_k=2).search().query == "Why?"
    long = RagRequest(
        question="q" * 10,
        top_k=2,
        history=(history[0].model_copy(update={"text": "x" * MAX_QUESTION_CHARS}), history[1]),
    )
    query = long.search().query
    assert len(query) == MAX_QUESTION_CHARS and query.startswith("q" * 10 + "\nx")


def test_a_query_may_carry_history_which_the_gateway_checks_before_any_engine_call(client):
    question = {"question": "When is its harvest festival?", "max_tokens": 2, "top_k": 1}
    history = [
        {"role": "user", "text": "What grows in the Melbrook valley?"},
        {"role": "assistant", "text": "Silver pears."},
    ]
    alone = client.post("/v1/query", json=question)
    followed = client.post("/v1/query", json={**question, "history": history})
    assert alone.status_code == followed.status_code == 200, followed.text
    assert followed.json()["dropped_turns"] == 0
    assert followed.json()["usage"]["prompt_tokens"] > alone.json()["usage"]["prompt_tokens"]
    assert [s["doc_id"] for s in followed.json()["sources"]] == ["orchards"]
    for wrong, named in (
        (history[::-1], "history.0.role is 'assistant'"),
        (history[:1], "history ends with a user turn"),
        ([history[0], {"role": "assistant", "text": " "}], "blank"),
    ):
        refused = client.post("/v1/query", json={**question, "history": wrong})
        assert refused.status_code == 422 and named in refused.text, refused.text
        assert not refused.json()["detail"].startswith("engine")
