"""The per-layer tensor operations of a Llama-family decoder, applied to any subset of tokens.

Built on the Hugging Face modules themselves (norms, projections, rotary embedding, MLP), so
q/k norms, qkv bias and scaled RoPE behave exactly as in the model's own forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.model.attention import AttentionPlan, QuerySpan


@dataclass(frozen=True)
class AttentionShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int


class LayerOps:
    """Runs embedding, decoder layers and the LM head of one loaded model on token subsets.

    Shapes: hidden h [n, d]; q [H, n, D]; k, v [H_kv, n, D]; caches [H_kv, T, D].
    """

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.decoder = model.model
        self.blocks = list(self.decoder.layers)
        config = model.config
        attn = self.blocks[0].self_attn
        self.shape = AttentionShape(
            num_layers=len(self.blocks),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=attn.head_dim,
            hidden_size=config.hidden_size,
        )
        self.windows = [self._sliding_window(layer.self_attn) for layer in self.blocks]
        # The family's own rotate_half keeps RoPE conventions (and any future variant) in one place.
        self._rotate_half = sys.modules[type(attn).__module__].rotate_half
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def _sliding_window(self, attn: torch.nn.Module) -> int | None:
        config = self.model.config
        if config.model_type == "mistral":
            return getattr(config, "sliding_window", None)
        return getattr(attn, "sliding_window", None)

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(token_ids)

    def rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, D] for positions 0..T-1, from the model's own rotary embedding: views
        of tables built once for the most positions asked (the KV pool asks for max_model_len)."""
        if self._rope is None or self._rope[0].shape[0] < num_positions:
            positions = torch.arange(num_positions, device=self.device)[None]
            probe = torch.empty(1, dtype=self.dtype, device=self.device)
            cos, sin = self.decoder.rotary_emb(probe, positions)
            self._rope = cos[0], sin[0]
        cos, sin = self._rope
        return cos[:num_positions], sin[:num_positions]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to x [heads, n, D] at the positions whose cos/sin [n, D] are given."""
        return x * cos + self._rotate_half(x) * sin

    def project_qkv(
        self, index: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [H, n, D], pre-RoPE k [H_kv, n, D] and v [H_kv, n, D] of layer `index`."""
        layer = self.blocks[index]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        n, head_dim = x.shape[0], self.shape.head_dim
        q = attn.q_proj(x).view(n, -1, head_dim)
        k = attn.k_proj(x).view(n, -1, head_dim)
        v = attn.v_proj(x).view(n, -1, head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def attention_plan(self, query_positions: list[int]) -> AttentionPlan:
        """How every layer attends from these sorted, unique query positions (AttentionPlan)."""
        return AttentionPlan(query_positions, self.dtype, self.device)

    def attention_scale(self, index: int) -> float:
        return float(self.blocks[index].self_attn.scaling)

    def attend(
        self,
        index: int,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """Attention of rotated q [H, n, D] over keys/values [H_kv, T, D] -> [n, H*D].

        The n queries are `plan`'s positions. A query at position p sees exactly the keys at
        positions <= p (and inside the sliding window, if the layer has one).
        """
        window = self.windows[index]
        scale = self.attention_scale(index)
        parts = []
        for span in plan.spans:
            if span.causal and (window is None or span.key_end <= window):
                parts.append(self._attend_causal(q, keys, values, plan, span, scale))
                continue
            for block in plan.blocks(span):
                parts.append(
                    F.scaled_dot_product_attention(
                        q[None, :, block.start : block.end],
                        keys[None, :, : block.key_end],
                        values[None, :, : block.key_end],
                        attn_mask=plan.mask(block, window),
                        scale=scale,
                        enable_gqa=True,
                    )[0]
                )
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out.transpose(0, 1).reshape(q.shape[1], -1)

    def _attend_causal(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        plan: AttentionPlan,
        span: QuerySpan,
        scale: float,
    ) -> torch.Tensor:
        """The run's queries as the last rows of a causal square over keys 0..key_end-1; the
        padding rows in front (zeros, their outputs dropped) align the kernel's diagonal."""
        padding = span.key_end - (span.end - span.start)
        queries = q[:, span.start : span.end]
        if padding:
            queries = plan.padded_queries(span, q.shape[0], q.shape[2])
            queries[:, padding:] = q[:, span.start : span.end]
        out = F.scaled_dot_product_attention(
            queries[None],
            keys[None, :, : span.key_end],
            values[None, :, : span.key_end],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )[0]
        return out[:, padding:]

    def finish_layer(self, index: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP block of layer `index`."""
        layer = self.blocks[index]
        h = h + layer.self_attn.o_proj(attn_out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Logits [vocab] (float32) of one hidden state [d]."""
        return self.logits_batch(h_last[None])[0]

    def logits_batch(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] (float32) of hidden states [n, d]."""
        return self.model.lm_head(self.decoder.norm(h)).float()
