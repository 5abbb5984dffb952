"""The demo model's structured initialisation: at step 0, layer 0 copies the tokens the corpus
puts a subject, a relation and a referent at, layer 1 finds the asked fact's value (named or
pronoun) and layer 2 the second hop's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from demo import MODEL_DIR
from demo.circuit import OFFSETS, Circuit, install
from demo.corpus import (
    HOP_RELATION_OFFSET,
    MULTI_QUESTIONS,
    NAMES,
    PERSON_RELATIONS,
    REFERENT_OFFSET,
    SUBJECT_OFFSET,
    CorpusGenerator,
)
from engine.blend.layout import PromptBuilder


def _tokenizer():
    return PreTrainedTokenizerFast.from_pretrained(MODEL_DIR)


def _fresh_model(tokenizer, seed: int = 0, circuit: bool = True, rope_theta: float = 1e6):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_theta=rope_theta,
    )
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("eager")
    if circuit:
        install(model, tokenizer, Circuit(seed=seed))
    return model.eval()


def _prompt(builder, question, passages) -> list[int]:
    return list(builder.build(question, passages).token_ids)


def test_templates_put_the_subject_as_far_before_a_value_as_before_the_answer():
    builder = PromptBuilder(_tokenizer())
    encode = builder.tokenizer.encode
    name = NAMES[0]
    for relation, (named, _, question) in PERSON_RELATIONS.items():
        fact = encode(" " + named.format(s=name, v="baker"))
        value, subject = fact.index(encode(" baker")[0]), fact.index(encode(" " + name)[0])
        asked = _prompt(builder, question.format(s=name), ())
        answer_at = len(asked) - 1  # the logit there predicts the answer's first token
        assert value - subject == answer_at - asked.index(fact[subject]) == SUBJECT_OFFSET
        word = encode(f" {relation}")[0]
        assert value - fact.index(word) == answer_at - asked.index(word) == SUBJECT_OFFSET + 2


def test_a_pronoun_fact_is_referent_offset_after_the_subject_of_the_passage_before():
    builder = PromptBuilder(_tokenizer())
    encode = builder.tokenizer.encode
    _, pronoun, question = PERSON_RELATIONS["color"]
    layout = builder.build(
        question.format(s=NAMES[0]),
        [
            PERSON_RELATIONS["job"][0].format(s=NAMES[0], v="baker"),
            pronoun.format(v="grey"),
        ],
    )
    ids = list(layout.token_ids)
    value, subject = ids.index(encode(" grey")[0]), ids.index(encode(" " + NAMES[0])[0])
    assert value - subject == REFERENT_OFFSET
    # ... and its relation word stands where a named fact's subject does.
    assert value - ids.index(encode(" color")[0]) == SUBJECT_OFFSET


def test_a_multi_hop_question_asks_its_relation_hop_offset_before_the_answer():
    builder = PromptBuilder(_tokenizer())
    for relation, question in MULTI_QUESTIONS.items():
        asked = _prompt(builder, question.format(s=NAMES[0]), ())
        word = builder.tokenizer.encode(f" {relation}")[0]
        assert len(asked) - 1 - asked.index(word) == HOP_RELATION_OFFSET


@torch.no_grad()
def test_layer_zero_heads_attend_exactly_their_offset_back():
    tokenizer = _tokenizer()
    model = _fresh_model(tokenizer)
    example = next(CorpusGenerator(3).examples(1))
    ids = _prompt(PromptBuilder(tokenizer), example.question, example.passages)
    attention = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions[0][0]
    for head, offset in enumerate(OFFSETS.values()):
        looked = attention[head, offset:].argmax(-1)
        assert torch.equal(looked, torch.arange(len(ids) - offset)), (head, offset)


def _found(model, builder, kinds, layer: int, count: int = 60) -> float:
    """Share of fresh examples of `kinds` where `layer`'s lookup head, at the answer position,
    puts the most weight of all facts' values on the answer's value in a gold passage."""
    tokenizer = builder.tokenizer
    it, is_ = tokenizer.encode(" It")[0], tokenizer.encode(" is")[0]
    generator = CorpusGenerator(77)
    hits = 0
    for i in range(count):
        example = generator.example(kinds[i % len(kinds)])
        layout = builder.build(example.question, example.passages)
        ids = list(layout.token_ids)
        end = len(ids) - len(layout.suffix)
        values = [p for p in range(2, end) if ids[p - 2] == it and ids[p - 1] == is_]
        gold = {
            p
            for p in values
            if ids[p] == tokenizer.encode(" " + example.answer)[0]
            and any(
                s <= p < s + n for k, (s, n) in enumerate(layout.chunk_spans) if k in example.gold
            )
        }
        weights = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        weights = weights[layer][0, 0, -1]
        hits += max(values, key=lambda p: weights[p].item()) in gold
    return hits / count


@torch.no_grad()
def test_layer_one_finds_the_asked_fact_named_or_by_pronoun_at_step_zero():
    builder = PromptBuilder(_tokenizer())
    found = _found(_fresh_model(builder.tokenizer), builder, ("single", "context"), layer=1)
    # A random initialisation picks among the 3-8 values of a prompt: about 0.2.
    unwired = _found(
        _fresh_model(builder.tokenizer, circuit=False), builder, ("single", "context"), 1
    )
    assert found >= 0.9 > 0.5 > unwired


@torch.no_grad()
def test_layer_two_finds_the_second_hop_of_a_multi_hop_question_at_step_zero():
    builder = PromptBuilder(_tokenizer())
    assert _found(_fresh_model(builder.tokenizer), builder, ("multi",), layer=2) >= 0.7


def test_install_names_a_rope_base_too_fast_for_the_lookups():
    tokenizer = _tokenizer()
    with pytest.raises(ValueError, match="rope_theta 100 leaves"):
        _fresh_model(tokenizer, rope_theta=100.0)
