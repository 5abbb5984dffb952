"""A prefill's dense work (projections, MLPs) handed out of its layer loop: one prefill runs it at
once, and the prefills of a step run the work of the same layer and kind as one batch."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine.model.layers import LayerOps

T = TypeVar("T")


@dataclass(eq=False)
class Dense:
    """Layer `layer`'s projections of rows `h` [n, d] (`attn_out` None: q, k, v back) or its
    output projection and MLP after their attention `attn_out` [n, H*D] (h [n, d] back)."""

    ops: LayerOps
    layer: int
    h: torch.Tensor
    attn_out: torch.Tensor | None = None

    @property
    def key(self) -> tuple[int, int]:
        """Work that may share a batch has the same key; lower keys come first in a forward."""
        return self.layer, int(self.attn_out is not None)

    def run(self) -> Any:
        if self.attn_out is None:
            return self.ops.project_qkv(self.layer, self.h)
        return self.ops.finish_layer(self.layer, self.h, self.attn_out)


# A prefill: it yields Dense work (sent back its result) or None to pause until the next step.
Pausable = Generator[Dense | None, Any, T]


def run_batch(work: list[Dense]) -> list[Any]:
    """The results of same-key `work`, computed as one batch over the concatenated rows."""
    if len(work) == 1:
        return [work[0].run()]
    sizes = [item.h.shape[0] for item in work]
    head = work[0]
    h = torch.cat([item.h for item in work])
    if head.attn_out is None:
        q, k, v = head.ops.project_qkv(head.layer, h)
        return list(zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1), strict=True))
    attn_out = torch.cat([item.attn_out for item in work])  # type: ignore[misc]
    return list(head.ops.finish_layer(head.layer, h, attn_out).split(sizes))


def side_by_side(num_tokens: list[int], limit: int) -> list[list[int]]:
    """Prefills (indices, in order) grouped to run side by side: consecutive ones while their
    prompts total at most `limit` tokens; one over it runs alone (limit 0: each alone)."""
    groups: list[list[int]] = []
    total = 0
    for index, tokens in enumerate(num_tokens):
        if groups and total + tokens <= limit:
            groups[-1].append(index)
            total += tokens
        else:
            groups.append([index])
            total = tokens
    return groups


def resume(pausable: Pausable[T], value: Any = None) -> tuple[bool, Dense | None, T | None]:
    """Send `value` (None: start or resume after a pause): (returned, its next work, result)."""
    try:
        work = pausable.send(value)
    except StopIteration as stop:
        return True, None, stop.value
    return False, work, None


def advance_together(
    pausables: list[Pausable[T]],
    on_done: Callable[[int, T], None],
    on_error: Callable[[int, Exception], None],
) -> None:
    """Run every prefill until it pauses or returns, the dense work they hand out at the same
    layer and kind computed as one batch (the lowest layer first, so those behind catch up).
    `on_done(index, result)` as each returns; `on_error(index, exc)` where one (or the batch
    it was in, or its `on_done`) raised, the rest going on. Call it in inference mode."""
    waiting: dict[int, Dense] = {}

    def step(index: int, value: Any) -> None:
        try:
            done, work, result = resume(pausables[index], value)
        except Exception as exc:
            on_error(index, exc)
            return
        if done:
            try:
                on_done(index, result)  # type: ignore[arg-type]
            except Exception as exc:
                on_error(index, exc)
        elif work is not None:
            waiting[index] = work

    for index in range(len(pausables)):
        step(index, None)
    while waiting:
        key = min(work.key for work in waiting.values())
        batch = [index for index, work in waiting.items() if work.key == key]
        try:
            results = run_batch([waiting.pop(index) for index in batch])
        except Exception as exc:
            for index in batch:
                pausables[index].close()
                on_error(index, exc)
            continue
        for index, result in zip(batch, results, strict=True):
            step(index, result)


def advance(pausable: Pausable[T]) -> tuple[bool, T | None]:
    """Run a prefill until it pauses (False, None) or returns (True, its result), its dense work
    run as it comes. Inference mode is entered per resumption: a mode held across a yield
    would leak into the caller."""
    with torch.inference_mode():
        done, work, result = resume(pausable)
        while work is not None:
            done, work, result = resume(pausable, work.run())
    return done, result


def run_to_end(pausable: Pausable[T]) -> T:
    """Drive a pausable that never pauses (an unbounded prefill, a decode) to its result."""
    done, result = advance(pausable)
    if not done:
        raise RuntimeError("an unbounded prefill paused")
    return result  # type: ignore[return-value]
