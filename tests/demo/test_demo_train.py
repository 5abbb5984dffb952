"""Training-side invariants of the demo model: packed question branches see exactly what an
ordinary prompt sees, and the extra questions a prompt is trained on are answered by it."""

from __future__ import annotations

import random

import pytest
import torch

from demo import MODEL_DIR
from demo.corpus import CorpusGenerator, is_pronoun_passage
from demo.train import collate, document, encode, losses, optimizers
from engine.blend.layout import PromptBuilder


def _builder_and_model(attention: str = "sdpa"):
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(MODEL_DIR)
    model = LlamaForCausalLM.from_pretrained(
        MODEL_DIR, dtype=torch.float32, attn_implementation=attention
    ).eval()
    return PromptBuilder(tokenizer), model


def test_packed_context_and_first_branch_are_the_engine_prompt():
    builder, _ = _builder_and_model()
    for example in CorpusGenerator(5).examples(20):
        packed = encode(builder, example, extra=3, rng=random.Random(0))
        layout = builder.build(example.question, example.passages)
        first = packed.branches[0][: packed.answer_starts[0]]
        assert packed.context + first == list(layout.token_ids)
        assert len(packed.branches) == 1 + min(3, len(example.also))


def test_document_rows_start_as_the_engine_computes_a_chunk_alone():
    builder, _ = _builder_and_model()
    example = next(CorpusGenerator(6).examples(1))
    row = document(builder, example)
    alone = list(builder.chunk_prefix) + list(builder.chunk_tokens(example.passages[0]))
    assert row.context[: len(alone)] == alone and not row.branches
    batch = collate([row, encode(builder, example)], builder.tokenizer.pad_token_id)
    assert not batch[4][0].any()  # no answer positions in a document row


# Training runs eager attention; the engine runs SDPA. The mask must mean the same to both.
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@torch.no_grad()
def test_each_packed_branch_gets_the_logits_of_its_own_unpacked_prompt(attention):
    builder, model = _builder_and_model(attention)
    examples = list(CorpusGenerator(4).examples(3))
    rows = [encode(builder, e, extra=3, rng=random.Random(1)) for e in examples]
    _, _, packed = losses(model, collate(rows, builder.tokenizer.pad_token_id))
    alone = []
    for row in rows:
        n = len(row.context)
        for branch, start in zip(row.branches, row.answer_starts, strict=True):
            logits = model(input_ids=torch.tensor([row.context + branch])).logits[0]
            alone.append(logits[n + start - 1 : n + len(branch) - 1])
    alone = torch.cat(alone)
    assert packed.shape == alone.shape
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


def test_extra_questions_are_answered_once_by_the_passages():
    for example in CorpusGenerator(11).examples(200):
        asked = [q.question for q in example.also]
        assert example.question not in asked and len(set(asked)) == len(asked)
        for q in example.also:
            holders = [p for p in example.passages if f"It is {q.answer}." in p]
            assert holders, (q, example.passages)
            if q.kind == "context":
                assert any(is_pronoun_passage(p) for p in holders)


def test_muon_gets_the_hidden_matrices_and_adamw_everything_else():
    from argparse import Namespace

    _, model = _builder_and_model()
    args = Namespace(optimizer="muon", lr=1e-3, muon_lr=0.02)
    adamw, muon = optimizers(model, args)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    in_adamw = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert not in_muon & in_adamw and in_muon | in_adamw == set(names.values())
    projections = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))
    assert in_muon == {n for n in names.values() if n.endswith(projections)}
    assert "model.embed_tokens.weight" in in_adamw and "model.norm.weight" in in_adamw
    assert {g["peak"] for g in muon.param_groups} == {0.02}
    assert len(optimizers(model, Namespace(optimizer="adamw", lr=1e-3, muon_lr=0.02))) == 1
