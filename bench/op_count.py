"""Kernel-like ATen ops and read-backs of what one thread runs, counted on the CPU: a proxy for
a GPU's kernel launches and device-to-host syncs that does not drift with the machine.

Every ATen op the dispatcher runs below autograd counts (composite ops arrive as the ops they
are made of), but views, allocations and metadata, which launch nothing. A read-back is a call
that would wait for a GPU: `.tolist()`, `.item()`, `bool()`/`int()`/`float()` of a tensor,
`nonzero`, `masked_select`, `.cpu()`, a boolean mask index. Dispatch and function modes, unlike
torch.profiler, count on whichever thread enters them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that launch nothing on a GPU: views, allocations, metadata.
NOT_KERNELS = frozenset(
    f"aten::{name}"
    for name in (
        *("view", "as_strided", "alias", "detach", "detach_", "t", "transpose", "transpose_"),
        *("permute", "expand", "expand_as", "slice", "select", "narrow", "unsqueeze"),
        *("squeeze", "unflatten", "flatten", "reshape", "_reshape_alias", "_unsafe_view"),
        *("split", "split_with_sizes", "unbind", "chunk", "view_as_real", "view_as_complex"),
        *("empty", "empty_like", "empty_strided", "resize_", "lift_fresh", "set_"),
        *("is_nonzero", "result_type", "_local_scalar_dense", "size", "stride", "numel"),
        *("dim", "to", "contiguous", "resolve_conj", "resolve_neg", "_pin_memory", "is_pinned"),
    )
)
# Calls that read a tensor back to the host: a sync on a GPU.
READ_BACKS = frozenset(
    (
        *("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"),
        *("masked_select", "argwhere", "cpu", "numpy", "unique"),
    )
)


@dataclass
class OpCount:
    kernels: int = 0  # kernel-like ATen ops
    ops: int = 0  # every ATen op, views included
    read_backs: int = 0
    names: Counter = field(default_factory=Counter)  # kernel-like ops by name

    def __iadd__(self, other: OpCount) -> OpCount:
        self.kernels += other.kernels
        self.ops += other.ops
        self.read_backs += other.read_backs
        self.names += other.names
        return self


class _Kernels(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten::{func.overloadpacket.__name__}"
        self.count.ops += 1
        if name not in NOT_KERNELS:
            self.count.kernels += 1
            self.count.names[name] += 1
        return func(*args, **(kwargs or {}))


class _ReadBacks(TorchFunctionMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name in ("__getitem__", "__setitem__") and _has_bool_index(args[1:2])
        if name in READ_BACKS or masked:
            self.count.read_backs += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(index: tuple) -> bool:
    items = index[0] if index and isinstance(index[0], tuple) else index
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in items)


@contextmanager
def counting() -> Iterator[OpCount]:
    """Count what the calling thread runs inside the block."""
    count = OpCount()
    with _ReadBacks(count), _Kernels(count):
        yield count
