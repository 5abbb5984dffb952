"""A structured initialisation of the demo model: the name lookup that training alone never finds.

Layer 0 gets relative-position heads that copy the token a fixed number of places back; layer 1
gets heads that match those copies, so that from step 0 a question's answer position attends to
the value of the fact about the question's subject (why and what it took: engine/demo/README.md).
It relies on the corpus templates putting a fact's subject as far before its value as a question
puts it before `Answer:` (`corpus.SUBJECT_OFFSET`). Training then refines every weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import LlamaForCausalLM

from engine.demo.corpus import REFERENT_OFFSET, SUBJECT_OFFSET


@dataclass(frozen=True)
class Circuit:
    # Places back that the layer-0 heads copy from: a fact's subject and its relation word.
    offsets: tuple[int, ...] = (SUBJECT_OFFSET, SUBJECT_OFFSET + 2)
    # Layer-1 lookups, one per key group: (offset index read by the query, by the key). The
    # question's subject (seen from `Answer:`) against a fact's subject (seen from its value).
    lookups: tuple[tuple[int, int], ...] = ((0, 0),)
    sharpness: float = 50.0  # positional query scale: a softmax gap of ~6 to the neighbours
    copy_scale: float = 0.1  # what a positional head writes, against an embedding of norm ~0.7
    match_scale: float = 6.0  # lookup query/key scale (scores grow with its square)
    value_scale: float = 4.0  # how strongly a lookup head writes the token it finds
    span: int = 200  # positions over which a lookup must not be rotated away by RoPE
    seed: int = 0

    def with_pronouns(self) -> Circuit:
        """Also a head copying the subject of the passage before a pronoun passage, seen from
        its value, and a lookup of the question's subject against it."""
        return replace(self, offsets=self.offsets + (REFERENT_OFFSET,),
                       lookups=self.lookups + ((0, len(self.offsets)),))  # fmt: skip


@torch.no_grad()
def install(model: LlamaForCausalLM, circuit: Circuit = Circuit()) -> None:
    """Overwrite the freshly initialised `model` in place: layers 0 and 1 and the embeddings."""
    config = model.config
    heads, kv_heads, hidden = (config.num_attention_heads, config.num_key_value_heads,
                               config.hidden_size)  # fmt: skip
    head_dim = hidden // heads
    group = heads // kv_heads
    if (
        len(circuit.offsets) > heads
        or len(circuit.lookups) > kv_heads
        or config.num_hidden_layers < 2
    ):
        raise ValueError("the circuit needs a head per offset and a key group per lookup")
    generator = torch.Generator().manual_seed(circuit.seed)
    basis, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=generator))
    constant = basis[:, 0]
    # One private subspace per positional head.
    count = len(circuit.offsets)
    spaces = [basis[:, 1 + i * head_dim : 1 + (i + 1) * head_dim].T for i in range(count)]
    private = torch.cat(spaces)
    # What heads read a token's identity through and write it back with: the token subspace
    # only, so that copies never land in a private subspace.
    free = basis[:, 1 + count * head_dim :].T
    value, copy = free[:head_dim], free[head_dim : 2 * head_dim]

    embed = model.model.embed_tokens.weight
    embed -= (embed @ private.T) @ private
    # Every token gets the same component along `constant` and none of its own, so that after
    # RMSNorm a query or key read from it is the same vector at every position: attention that
    # depends on relative position alone.
    embed -= (embed @ constant)[:, None] * constant
    embed += constant * 2 * embed.norm(dim=1).mean()
    normed = embed / embed.pow(2).mean(dim=1, keepdim=True).sqrt()
    level = (normed @ constant).mean()

    _positional_heads(model, circuit, spaces, constant / level, value, head_dim, group)
    _lookup_heads(model, circuit, spaces, copy, head_dim, group)
    _keep_out(model, private, circuit, head_dim, group)


def _frequencies(model: LlamaForCausalLM, head_dim: int) -> torch.Tensor:
    theta = model.config.rope_parameters["rope_theta"]
    return theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)


def _positional_heads(model, circuit, spaces, reader, value, head_dim, group) -> None:
    """Heads 0.. of layer 0: head h attends `offsets[h]` places back and writes a copy of that
    token into `spaces[h]`, all through the same value map, so that copies made at different
    distances can be compared. RoPE turns a constant query q and key k into a score
    sum_p Re(q_p conj(k_p) e^{i d theta_p}) at distance d; q_p = A e^{-i k theta_p} and k_p = 1
    peak it at d = k."""
    attention = model.model.layers[0].self_attn
    half = head_dim // 2
    theta = _frequencies(model, head_dim)
    for kv in range(-(-len(circuit.offsets) // group)):
        rows = slice(kv * head_dim, (kv + 1) * head_dim)
        attention.k_proj.weight[rows] = 0
        attention.k_proj.weight[kv * head_dim : kv * head_dim + half] = reader
        attention.v_proj.weight[rows] = value
    for head, offset in enumerate(circuit.offsets):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        phase = offset * theta
        query = circuit.sharpness * torch.cat([torch.cos(phase), -torch.sin(phase)])
        attention.q_proj.weight[rows] = query[:, None] * reader
        attention.o_proj.weight[:, rows] = circuit.copy_scale * spaces[head].T


def _lookup_heads(model, circuit, spaces, copy, head_dim, group) -> None:
    """Key group g of layer 1 serves lookups[g]: its queries read one positional head's copy and
    its keys another's, so a position attends to the positions whose copied token is its own
    (the question's subject at `Answer:` against a fact's subject, or a pronoun fact's
    referent), and writes the token found there. Only RoPE pairs slow enough not to turn over
    within `span` positions carry a match."""
    half = head_dim // 2
    theta = _frequencies(model, head_dim)
    slow = [p for p in range(half) if theta[p] * circuit.span < 1.0]
    rows = torch.tensor(slow + [p + half for p in slow])
    attention = model.model.layers[1].self_attn
    for kv, (asks, holds) in enumerate(circuit.lookups):
        base = kv * head_dim
        attention.k_proj.weight[base : base + head_dim] = 0
        attention.k_proj.weight[base + rows] = circuit.match_scale * spaces[holds][: len(rows)]
        attention.v_proj.weight[base : base + head_dim] = copy
        for head in range(kv * group, (kv + 1) * group):
            attention.q_proj.weight[head * head_dim : (head + 1) * head_dim] = 0
            attention.q_proj.weight[head * head_dim + rows] = (
                circuit.match_scale * spaces[asks][: len(rows)]
            )
            attention.o_proj.weight[:, head * head_dim : (head + 1) * head_dim] = (
                circuit.value_scale / group * copy.T
            )


def _keep_out(model, private, circuit, head_dim, group) -> None:
    """Nothing but the circuit's own heads may write into the private subspaces up to the last
    layer that reads them, or the lookups would match on noise shared by every position."""
    own = (len(circuit.offsets), len(circuit.lookups) * group)  # heads of layers 0 and 1
    for layer, heads in zip(model.model.layers[:2], own, strict=True):
        out = layer.self_attn.o_proj.weight[:, heads * head_dim :]
        out -= private.T @ (private @ out)
        down = layer.mlp.down_proj.weight
        down -= private.T @ (private @ down)
