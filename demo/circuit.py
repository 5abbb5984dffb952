"""A structured initialisation of the demo model: the fact lookups that training alone never finds.

Layer 0 gets relative-position heads that copy the token a fixed number of places back; layer 1
a head that matches those copies against the question's, so that from step 0 `Answer:` attends
to the value of the asked fact, named or stated by pronoun; layer 2 a head that looks the found
value up again (the second hop of a multi-hop question). It relies on the corpus templates
(corpus.py: the offsets) and is explained in demo/README.md. Training refines every weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from demo.corpus import (
    CITY_RELATIONS,
    HOP_RELATION_OFFSET,
    MULTI_QUESTIONS,
    NAMES,
    PERSON_RELATIONS,
    REFERENT_OFFSET,
    SUBJECT_OFFSET,
)
from engine.blend.layout import PromptBuilder

# Copies made by layer 0, with how far back each looks. "mark" keeps only whether the token just
# before is " is", which precedes every fact's value (and, in a question, "the").
OFFSETS = {
    "subject": SUBJECT_OFFSET,
    "relation": SUBJECT_OFFSET + 2,
    "referent": REFERENT_OFFSET,
    "hop": HOP_RELATION_OFFSET,
    "mark": 1,
}
SPACES = ("subject", "relation", "referent", "hop", "found")


@dataclass(frozen=True)
class Circuit:
    sharpness: float = 50.0  # positional query scale: a softmax gap of ~25 to the neighbours
    copy_scale: float = 0.1  # what a positional head writes, against an embedding of norm ~0.4
    match_scale: float = 8.0  # logits per unit of a lookup's score
    value_scale: float = 4.0  # how strongly a lookup head writes the token it finds
    found_scale: float = 0.1  # how strongly layer 1 hands its find to layer 2
    span: int = 128  # the farthest a lookup must reach (prompts of up to 6 passages)
    turn: float = 0.5  # RoPE may turn a matching pair by at most this over `span`
    relation_pairs: int = 4  # slow RoPE pairs that compare relation words (the rest: names)
    # A lookup's score, in units: the asked subject stated by name 4 back (named fact) or 13 back
    # (pronoun fact, whose referent ends the passage before), the asked relation 6 back (named)
    # or 4 back (pronoun), and " is" 1 back. The asked fact scores 4, everything else at most 3.
    subject: float = 1.0
    referent: float = 1.0
    relation: float = 2.0
    pronoun_relation: float = 2.0
    mark: float = 1.0
    second_hop: bool = True
    seed: int = 0


@dataclass(frozen=True)
class _Layout:
    """Directions in the residual stream and head dimensions that the circuit owns."""

    constant: torch.Tensor  # every token's shared component: lets RoPE alone set layer 0's scores
    spaces: dict[str, torch.Tensor]  # private [head_dim, hidden] subspaces for copies
    mark: torch.Tensor  # private direction: the previous token was " is"
    value: torch.Tensor  # [head_dim, hidden] token subspace that heads read and write through
    subject_rows: torch.Tensor  # head dims (slow RoPE pairs) comparing names
    relation_rows: torch.Tensor  # ... comparing relation words
    mark_row: int  # ... carrying the " is" mark

    @property
    def private(self) -> torch.Tensor:
        return torch.cat([*self.spaces.values(), self.mark[None]])


@torch.no_grad()
def install(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, circuit: Circuit = Circuit()
) -> None:
    """Overwrite the freshly initialised `model` in place: embeddings and layers 0-2."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    if layers < 2 + circuit.second_hop or heads < len(OFFSETS):
        raise ValueError(
            f"the circuit needs {2 + circuit.second_hop} layers and "
            f"{len(OFFSETS)} heads; the model has {layers} and {heads}"
        )
    layout = _layout(model, circuit)
    _embeddings(model, tokenizer, layout, circuit.seed)
    _positional_heads(model, circuit, layout)
    _keep_out(model, layout, 0, len(OFFSETS))
    stats = _calibrate(model, tokenizer, layout, layer=1)
    _lookup(
        model,
        circuit,
        layout,
        stats,
        1,
        ask="subject",
        ask_relation="relation",
        hand_over=circuit.second_hop,
    )
    _keep_out(model, layout, 1, _group(model))
    if circuit.second_hop:
        stats = _calibrate(model, tokenizer, layout, layer=2)
        # Layer 1 hands its find over at found_scale where a copy has copy_scale.
        _lookup(
            model,
            circuit,
            layout,
            stats,
            2,
            ask="found",
            ask_relation="hop",
            ask_scale=circuit.copy_scale / circuit.found_scale,
        )
        _keep_out(model, layout, 2, 0)


def _group(model) -> int:
    return model.config.num_attention_heads // model.config.num_key_value_heads


def _head_dim(model) -> int:
    return model.config.hidden_size // model.config.num_attention_heads


def _frequencies(model, head_dim: int) -> torch.Tensor:
    theta = model.config.rope_parameters["rope_theta"]
    return theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)


def _layout(model, circuit: Circuit) -> _Layout:
    hidden, head_dim = model.config.hidden_size, _head_dim(model)
    generator = torch.Generator().manual_seed(circuit.seed)
    basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=generator))[0].T
    spaces = {
        name: basis[1 + i * head_dim : 1 + (i + 1) * head_dim] for i, name in enumerate(SPACES)
    }
    at = 1 + len(SPACES) * head_dim
    if at + 1 + head_dim > hidden:
        raise ValueError(f"the circuit needs a hidden size of {at + 1 + head_dim}, not {hidden}")
    half = head_dim // 2
    theta = _frequencies(model, head_dim)
    slow = [p for p in reversed(range(half)) if theta[p] * circuit.span <= circuit.turn]
    needed = circuit.relation_pairs + 3
    if len(slow) < needed:
        base = model.config.rope_parameters["rope_theta"]
        raise ValueError(
            f"rope_theta {base:g} leaves {len(slow)} slow RoPE pairs; the lookups need {needed}"
        )
    relation, subject = slow[1 : 1 + circuit.relation_pairs], slow[1 + circuit.relation_pairs :]

    def rows(pairs):
        return torch.tensor(pairs + [p + half for p in pairs])

    return _Layout(
        basis[0],
        spaces,
        basis[at],
        basis[at + 1 : at + 1 + head_dim],
        rows(subject),
        rows(relation),
        slow[0],
    )


def _subject_coords(layout: _Layout) -> torch.Tensor:
    return torch.arange(len(layout.subject_rows))


def _relation_coords(layout: _Layout) -> torch.Tensor:
    start = len(layout.subject_rows)
    return torch.arange(start, start + len(layout.relation_rows))


def _embeddings(model, tokenizer, layout: _Layout, seed: int) -> None:
    """Token identity in the value coordinates the lookups compare: every name gets a random
    direction of one fixed length among the subject coordinates; relation words orthogonal
    directions among the relation coordinates; template words neither (they must never match);
    " is" alone the last value coordinate. All rows get one norm and one shared `constant`
    component, so that after RMSNorm a positional query or key is the same at every token."""
    embed = model.model.embed_tokens.weight
    embed -= (embed @ layout.private.T) @ layout.private
    embed -= (embed @ layout.constant)[:, None] * layout.constant
    size = embed.norm(dim=1).mean()
    names = layout.value[_subject_coords(layout)]
    relations = layout.value[_relation_coords(layout)]
    is_direction = layout.value[-1]
    for directions in (names, relations, is_direction[None]):
        embed -= (embed @ directions.T) @ directions
    words = _template_tokens(tokenizer)
    relation_ids = _relation_tokens(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    part = torch.randn(len(embed), len(names), generator=generator)
    part[words] = 0
    embed += part / part.norm(dim=1, keepdim=True).clamp_min(1e-9) @ names * 0.5 * size
    basis = torch.linalg.qr(torch.randn(len(relations), len(relations), generator=generator))[0]
    embed[relation_ids] += basis[: len(relation_ids)] @ relations * 0.5 * size
    embed[_token(tokenizer, "is")] += is_direction * size
    embed *= size / embed.norm(dim=1, keepdim=True)
    embed += layout.constant * 2 * size


def _token(tokenizer, word: str) -> int:
    ids = tokenizer.encode(" " + word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the circuit needs {word!r} to be one token, got {ids}")
    return ids[0]


def _relation_tokens(tokenizer) -> list[int]:
    return [_token(tokenizer, r) for r in (*PERSON_RELATIONS, *CITY_RELATIONS)]


def _template_tokens(tokenizer) -> list[int]:
    """Every token of the facts and questions as the engine lays them out, but their names."""
    builder = PromptBuilder(tokenizer)
    subject, value = NAMES[0], NAMES[1]
    ids: set[int] = set()
    for named, pronoun, question in (*PERSON_RELATIONS.values(), *CITY_RELATIONS.values()):
        for text in (named, pronoun):
            ids.update(builder.chunk_tokens(text.format(s=subject, v=value)))
        ids.update(builder.build(question.format(s=subject), ()).suffix)
    for question in MULTI_QUESTIONS.values():
        ids.update(builder.build(question.format(s=subject), ()).suffix)
    ids -= {_token(tokenizer, subject), _token(tokenizer, value)}
    return sorted(ids)


def _positional_heads(model, circuit: Circuit, layout: _Layout) -> None:
    """Head h of layer 0 attends OFFSETS[h] places back and writes that token's value
    coordinates into its private space (the mark head: only the " is" coordinate). RoPE turns a
    constant query q and key k into a score sum_p Re(q_p conj(k_p) e^{i d theta_p}) at distance
    d; q_p = A e^{-i k theta_p} and k_p = 1 on the fast pairs peak it at d = k."""
    attention = model.model.layers[0].self_attn
    head_dim, group = _head_dim(model), _group(model)
    half = head_dim // 2
    theta = _frequencies(model, head_dim)
    fast = (theta * circuit.span > circuit.turn).float().repeat(2)
    reader = _reader(model, layout)
    for kv in range(-(-len(OFFSETS) // group)):
        rows = slice(kv * head_dim, (kv + 1) * head_dim)
        attention.k_proj.weight[rows] = 0
        attention.k_proj.weight[kv * head_dim : kv * head_dim + half] = reader
        attention.v_proj.weight[rows] = layout.value
    for head, (name, offset) in enumerate(OFFSETS.items()):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        phase = offset * theta
        query = circuit.sharpness * fast * torch.cat([torch.cos(phase), -torch.sin(phase)])
        attention.q_proj.weight[rows] = query[:, None] * reader
        if name == "mark":
            out = torch.zeros(model.config.hidden_size, head_dim)
            out[:, -1] = layout.mark
        else:
            out = layout.spaces[name].T
        attention.o_proj.weight[:, rows] = circuit.copy_scale * out


def _reader(model, layout: _Layout) -> torch.Tensor:
    """Reads `constant` as 1 from an RMS-normalised embedding."""
    embed = model.model.embed_tokens.weight
    normed = embed / embed.pow(2).mean(dim=1, keepdim=True).sqrt()
    return layout.constant / (normed @ layout.constant).mean()


def _calibrate(model, tokenizer, layout: _Layout, layer: int) -> dict[str, float]:
    """Mean squared size of each block of copies and of the constant, as `layer` reads them
    (after its RMSNorm), on random tokens with a relation word every 5th and " is" every 7th."""
    generator = torch.Generator().manual_seed(layer)
    ids = torch.randint(3, model.config.vocab_size, (4, 140), generator=generator)
    relations = torch.tensor(_relation_tokens(tokenizer))
    ids[:, ::5] = relations[torch.randint(len(relations), ids[:, ::5].shape, generator=generator)]
    is_id = _token(tokenizer, "is")
    ids[:, ::7] = is_id
    hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states[layer]
    x = model.model.layers[layer].input_layernorm(hidden)

    def back(offset):  # the token `offset` places before each position from 16 on
        return ids[:, 16 - offset : ids.shape[1] - offset]

    x = x[:, 16:]
    subject = layout.spaces["subject"][_subject_coords(layout)]
    relation = layout.spaces["relation"][_relation_coords(layout)]
    named = ~torch.isin(back(SUBJECT_OFFSET), torch.tensor(_template_tokens(tokenizer)))
    related = torch.isin(back(OFFSETS["relation"]), relations)
    return {
        "subject": (x @ subject.T).pow(2).sum(-1)[named].mean().item(),
        "relation": (x @ relation.T).pow(2).sum(-1)[related].mean().item(),
        "mark": (x @ layout.mark)[back(1) == is_id].pow(2).mean().item(),
        "constant": (x @ layout.constant).mean().item(),
    }


def _lookup(
    model,
    circuit: Circuit,
    layout: _Layout,
    stats,
    layer: int,
    ask: str,
    ask_relation: str,
    ask_scale: float = 1.0,
    hand_over: bool = False,
) -> None:
    """Key group 0 of `layer`: its queries read the `ask` copy (a name, written ask_scale times
    weaker than a layer-0 copy) and the `ask_relation` copy, its keys every fact's subject,
    referent, relation and mark (the score in Circuit's units), and it writes the token found
    into the token subspace (and, with `hand_over`, into `found` for the next lookup)."""
    attention = model.model.layers[layer].self_attn
    head_dim, group = _head_dim(model), _group(model)
    scale = circuit.match_scale**0.5
    s_rows, r_rows = layout.subject_rows, layout.relation_rows
    s_coords, r_coords = _subject_coords(layout), _relation_coords(layout)
    s_norm, r_norm = stats["subject"] ** 0.5, stats["relation"] ** 0.5
    spaces = layout.spaces
    key = torch.zeros(head_dim, model.config.hidden_size)
    named, referent = spaces["subject"][s_coords], spaces["referent"][s_coords]
    key[s_rows] = scale / s_norm * (circuit.subject * named + circuit.referent * referent)
    relation, pronoun = spaces["relation"][r_coords], spaces["subject"][r_coords]
    key[r_rows] = (
        scale / r_norm * (circuit.relation * relation + circuit.pronoun_relation * pronoun)
    )
    key[layout.mark_row] = scale * circuit.mark / stats["mark"] ** 0.5 * layout.mark
    query = torch.zeros(head_dim, model.config.hidden_size)
    query[s_rows] = scale / s_norm * ask_scale * spaces[ask][s_coords]
    query[r_rows] = scale / r_norm * spaces[ask_relation][r_coords]
    query[layout.mark_row] = scale / stats["constant"] * layout.constant
    write = circuit.value_scale / group * layout.value.T
    if hand_over:
        write = write + circuit.found_scale / group * spaces["found"].T
    attention.k_proj.weight[:head_dim] = key
    attention.v_proj.weight[:head_dim] = layout.value
    for head in range(group):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        attention.q_proj.weight[rows] = query
        attention.o_proj.weight[:, rows] = write


def _keep_out(model, layout: _Layout, layer: int, own_heads: int) -> None:
    """Nothing but the circuit's own heads may write into the private subspaces, or the lookups
    would match on noise that every position shares: layer's other heads and its MLP."""
    private = layout.private
    block = model.model.layers[layer]
    out = block.self_attn.o_proj.weight[:, own_heads * _head_dim(model) :]
    out -= private.T @ (private @ out)
    down = block.mlp.down_proj.weight
    down -= private.T @ (private @ down)
