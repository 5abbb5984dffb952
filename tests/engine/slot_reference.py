"""The KV pool as it was before blocks: one slot of max_model_len positions per sequence and a
batched decode over the slots' views; what the paged decode must match and is timed against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.layers import LayerOps


class SlotPool:
    """Keys and values [L, S, H_kv, C, D]: S slots of C positions."""

    def __init__(self, ops: LayerOps, num_slots: int, slot_tokens: int):
        shape = ops.shape
        self.ops = ops
        pool_shape = (shape.num_layers, num_slots, shape.num_kv_heads, slot_tokens, shape.head_dim)
        self.keys = torch.zeros(pool_shape, dtype=ops.dtype, device=ops.device)
        self.values = torch.zeros(pool_shape, dtype=ops.dtype, device=ops.device)
        self.cos, self.sin = ops.rope_tables(slot_tokens)
        self.group = shape.num_heads // shape.num_kv_heads

    def write_prompt(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A prompt's KV [L, H_kv, n, D] into the first positions of `slot`."""
        n = keys.shape[2]
        self.keys[:, slot, :, :n] = keys
        self.values[:, slot, :, :n] = values

    def kv(self, slot: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, slot, :, :num_tokens], self.values[:, slot, :, :num_tokens]

    @torch.inference_mode()
    def decode(self, slots: list[int], positions: list[int], token_ids: list[int]) -> torch.Tensor:
        """The slot decode: SDPA over the slots [0, high) padded to the longest context."""
        ops, device = self.ops, self.ops.device
        shape = ops.shape
        batch = len(slots)
        slot_idx = torch.tensor(slots, device=device)
        pos = torch.tensor(positions, device=device)
        high, num_keys = max(slots) + 1, max(positions) + 1
        cos, sin = self.cos[pos], self.sin[pos]
        key_pos = torch.arange(num_keys, device=device)[None, :]
        row_pos = torch.zeros(high, dtype=torch.long, device=device)
        row_pos[slot_idx] = pos
        causal = key_pos <= row_pos[:, None]
        masks: dict[int | None, torch.Tensor] = {None: causal[:, None, None, :]}
        q_rows = torch.zeros(
            high, shape.num_kv_heads, self.group, shape.head_dim, dtype=ops.dtype, device=device
        )
        h = ops.embed(torch.tensor(token_ids, device=device))
        for i in range(shape.num_layers):
            q, k, v = ops.project_qkv(i, h)
            q = ops.rotate(q, cos, sin)
            k = ops.rotate(k, cos, sin)
            self.keys[i][slot_idx, :, pos] = k.transpose(0, 1)
            self.values[i][slot_idx, :, pos] = v.transpose(0, 1)
            window = ops.windows[i]
            if window not in masks:
                assert window is not None
                masks[window] = (causal & (key_pos > row_pos[:, None] - window))[:, None, None]
            q_rows[slot_idx] = q.transpose(0, 1).reshape(batch, shape.num_kv_heads, self.group, -1)
            out = F.scaled_dot_product_attention(
                q_rows,
                self.keys[i][:high, :, :num_keys],
                self.values[i][:high, :, :num_keys],
                attn_mask=masks[window],
                scale=ops.blocks[i].self_attn.scaling,
            )
            h = ops.finish_layer(i, h, out[slot_idx].reshape(batch, -1))
        return ops.logits_batch(h)
