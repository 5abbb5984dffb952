"""Prompt layout: chunk tokens independent of neighbours, chat and plain templates."""

from __future__ import annotations

from engine.blend.layout import PromptBuilder, PromptLayout
from engine.model.load import load_model
from engine.types import Turn


def test_chunk_tokens_do_not_depend_on_neighbours_or_order(checkpoint_dir):
    prompts = PromptBuilder(load_model(checkpoint_dir("llama")).tokenizer)
    a, b = "kalo vo zuren.", "tas pe drisol an."
    first = prompts.build("q?", [a, b])
    second = prompts.build("q?", [b, a])
    assert first.chunks == (prompts.chunk_tokens(a), prompts.chunk_tokens(b))
    assert second.chunks == (first.chunks[1], first.chunks[0])
    assert first.prefix == second.prefix and first.suffix == second.suffix


def test_plain_template_starts_with_bos_and_ends_with_the_question(checkpoint_dir):
    tokenizer = load_model(checkpoint_dir("llama")).tokenizer
    prompts = PromptBuilder(tokenizer)
    layout = prompts.build("where is kalo?", ["zu ka."])
    assert not prompts.uses_chat_template
    assert layout.prefix[0] == tokenizer.bos_token_id
    assert tokenizer.decode(layout.suffix).endswith("where is kalo?\nAnswer:")
    assert layout.chunk_spans == ((len(layout.prefix), len(layout.chunks[0])),)
    assert layout.num_tokens == len(layout.prefix) + len(layout.chunks[0]) + len(layout.suffix)


def test_chat_template_puts_passages_in_the_user_turn(checkpoint_dir):
    tokenizer = load_model(checkpoint_dir("qwen2")).tokenizer
    prompts = PromptBuilder(tokenizer, default_system="Be brief.")
    layout = prompts.build("where is kalo?", ["zu ka."])
    assert prompts.uses_chat_template
    prefix = tokenizer.decode(layout.prefix)
    suffix = tokenizer.decode(layout.suffix)
    assert prefix.startswith("<|im_start|>system\nBe brief.") and prefix.endswith(
        "<|im_start|>user\n"
    )
    assert suffix.startswith("Question: where is kalo?<|im_end|>")
    assert suffix.endswith("<|im_start|>assistant\n")


def test_a_template_without_a_system_turn_gets_the_system_text_in_the_user_turn(checkpoint_dir):
    tokenizer = load_model(checkpoint_dir("qwen2")).tokenizer
    tokenizer.chat_template = (  # like Mistral's: user/assistant only
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "[INST] {{ m['content'] }} [/INST]{% endfor %}"
    )
    layout = PromptBuilder(tokenizer, default_system="Be brief.").build("where?", ["zu ka."])
    prefix = tokenizer.decode(layout.prefix)
    assert prefix.startswith("[INST] Be brief.\nAnswer the question using the passages below.")
    assert tokenizer.decode(layout.suffix) == "Question: where? [/INST]"


def test_fitted_drops_chunks_from_the_end_until_the_prompt_fits():
    layout = PromptLayout(prefix=(1, 2), chunks=((3,) * 4, (4,) * 5, (5,) * 6), suffix=(9,))
    assert layout.fitted(100) == layout
    kept_two = layout.fitted(12)  # 3 + 4 + 5 = 12: the last chunk goes
    assert kept_two.chunks == layout.chunks[:2] and kept_two.dropped_chunks == 1
    assert kept_two.fitted(11).chunks == layout.chunks[:1]
    assert kept_two.fitted(11).dropped_chunks == 2
    none_fit = layout.fitted(2)  # prefix and suffix alone are 3: still too long, all dropped
    assert none_fit.chunks == () and none_fit.dropped_chunks == 3 and none_fit.num_tokens == 3


EARLIER = (Turn("user", "where is kalo?"), Turn("assistant", "in zu ka."))


def test_earlier_turns_go_between_the_passages_and_the_question_through_the_template(
    checkpoint_dir,
):
    tokenizer = load_model(checkpoint_dir("qwen2")).tokenizer
    prompts = PromptBuilder(tokenizer)
    alone = prompts.build("and its river?", ["zu ka."])
    layout = prompts.build("and its river?", ["zu ka."], history=EARLIER)
    assert layout.prefix == alone.prefix and layout.chunks == alone.chunks  # one prefix to cache
    assert tokenizer.decode(layout.suffix) == (
        "Question: where is kalo?<|im_end|>\n<|im_start|>assistant\nin zu ka.<|im_end|>\n"
        "<|im_start|>user\nQuestion: and its river?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_plain_template_writes_earlier_turns_as_answered_questions(checkpoint_dir):
    tokenizer = load_model(checkpoint_dir("llama")).tokenizer
    layout = PromptBuilder(tokenizer).build("and its river?", ["zu ka."], history=EARLIER)
    assert tokenizer.decode(layout.suffix) == (
        "Question: where is kalo?\nAnswer: in zu ka.\n\nQuestion: and its river?\nAnswer:"
    )


def test_a_template_without_a_system_turn_keeps_the_earlier_turns(checkpoint_dir):
    tokenizer = load_model(checkpoint_dir("qwen2")).tokenizer
    tokenizer.chat_template = (  # like Mistral's: user/assistant only
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
    )
    layout = PromptBuilder(tokenizer).build("and its river?", ["zu ka."], history=EARLIER)
    assert tokenizer.decode(layout.suffix) == (
        "Question: where is kalo? [/INST]in zu ka.</s>[INST] Question: and its river? [/INST]"
    )
