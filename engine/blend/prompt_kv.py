"""Where a prefill writes its prompt's KV as the layer loop goes: a buffer of its own (chunk
precompute, tests, direct calls), or the sequence's blocks of the KV pool (served requests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.model.paged_attention import token_rows


def device_index(values: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int64 index tensor on `device` from host values; on CUDA copied from pinned memory
    without a sync (a tensor built from a list straight on the device waits for the stream)."""
    host = torch.as_tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class PromptKV(Protocol):
    """The KV of a prompt of `num_tokens` positions over every layer, filled layer by layer."""

    num_tokens: int

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE) and values [H_kv, T, D] of layer `index`: the loop writes them,
        then attends over them."""
        ...

    def layer_done(self, index: int) -> None:
        """Layer `index` holds the prompt's final KV: keep it."""
        ...

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values [L, H_kv, n, D] of positions start..end-1, once every
        layer is done."""
        ...


class DenseKV:
    """A buffer [L, H_kv, T, D] of keys and values, allocated or the caller's (`keys`,
    `values`); each layer is written in place."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, num_kv_heads, num_tokens, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.num_tokens = num_tokens

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor) -> DenseKV:
        """The caller's tensors [L, H_kv, T, D] as the buffer."""
        assert keys.shape == values.shape and keys.dim() == 4, (keys.shape, values.shape)
        kv = cls.__new__(cls)
        kv.keys, kv.values, kv.num_tokens = keys, values, keys.shape[2]
        return kv

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]

    def layer_done(self, index: int) -> None:
        """Written in place: nothing to do."""

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, start:end].clone(), self.values[:, :, start:end].clone()


class PagedKV:
    """A sequence's blocks of the KV pool (keys and values [L, N, block_size, H_kv, D]) as a
    prefill's target. Each layer is built in one scratch [T, H_kv, D], token-major as the
    blocks are, which the loop sees as [H_kv, T, D]; once done it goes into the blocks in one
    indexed copy per K and V, but for the first `shared` positions: a shared prefix's blocks
    already hold them, and other sequences read them."""

    def __init__(
        self,
        pool: tuple[torch.Tensor, torch.Tensor],
        table: list[int],
        num_tokens: int,
        shared: int = 0,
    ):
        self.pool_keys, self.pool_values = pool
        _, _, self.block_size, num_kv_heads, head_dim = self.pool_keys.shape
        assert 0 <= shared < num_tokens, (shared, num_tokens)
        assert len(table) * self.block_size >= num_tokens, "the table holds the prompt"
        self.num_tokens, self.shared, self.table = num_tokens, shared, table
        device, dtype = self.pool_keys.device, self.pool_keys.dtype
        self._rows = device_index(self._rows_of(shared, num_tokens), device)
        # [2, T, H_kv, D]: keys then values, reused by every layer (each rewrites all positions).
        shape = (2, num_tokens, num_kv_heads, head_dim)
        self._scratch = torch.empty(shape, dtype=dtype, device=device)

    def _rows_of(self, start: int, end: int) -> torch.Tensor:
        """Rows of the pool flattened to [N * block_size, H_kv, D] of positions start..end-1."""
        return token_rows(torch.tensor(self.table), torch.arange(start, end), self.block_size)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._scratch[0].transpose(0, 1), self._scratch[1].transpose(0, 1)

    def layer_done(self, index: int) -> None:
        new = self._scratch[:, self.shared :]
        self.pool_keys[index].flatten(0, 1).index_copy_(0, self._rows, new[0])
        self.pool_values[index].flatten(0, 1).index_copy_(0, self._rows, new[1])

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = device_index(self._rows_of(start, end), self.pool_keys.device)
        keys = self.pool_keys.flatten(1, 2)[:, rows].transpose(1, 2)  # [L, H_kv, n, D]
        values = self.pool_values.flatten(1, 2)[:, rows].transpose(1, 2)
        return keys.contiguous(), values.contiguous()


# Where a caller asks a prefill to write: its PromptKV, (keys, values) [L, H_kv, T, D] of its
# own, or None (a buffer allocated for it).
KVOut = PromptKV | tuple[torch.Tensor, torch.Tensor] | None
