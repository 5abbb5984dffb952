"""What a prefill row costs an engine step: its dense work through a layer and its attention,
measured once on the engine's device (engine/budget.py counts a step's prefill work with it)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.layers import LayerOps

# The probe: this many query rows, the last ones of a causal prompt of PROBE_KEYS positions.
PROBE_ROWS = 128
PROBE_KEYS = 2048


@dataclass(frozen=True)
class StepCost:
    """`keys_per_token`: keys whose attention costs a row as much as its dense work (infinite:
    attention counts nothing); `seconds_per_token`: that dense work's time (0: not timed)."""

    keys_per_token: float = math.inf
    seconds_per_token: float = 0.0


@torch.inference_mode()
def measure_step_cost(ops: LayerOps, repeats: int = 3) -> StepCost:
    """Time layer 0's dense work and attention on random inputs (the median of `repeats`, after
    a warm-up). On a 2-core CPU in bfloat16, a 124M-parameter model's row reads ~3,000 keys for
    the price of its projections and MLP (~15 us), so at 3K of context attention is half a
    prefill's work."""
    shape, device, dtype = ops.shape, ops.device, ops.dtype
    keys = min(PROBE_KEYS, ops.windows[0] or PROBE_KEYS, ops.max_positions or PROBE_KEYS)
    rows = min(PROBE_ROWS, keys)
    h = torch.randn(rows, shape.hidden_size, dtype=dtype, device=device)
    q = torch.randn(shape.num_heads, rows, shape.head_dim, dtype=dtype, device=device)
    kv = torch.randn(shape.num_kv_heads, keys, shape.head_dim, dtype=dtype, device=device)
    plan = ops.attention_plan(list(range(keys - rows, keys)))
    attn_out = torch.zeros(rows, shape.num_heads * shape.head_dim, dtype=dtype, device=device)

    def dense() -> None:
        ops.project_qkv(0, h)
        ops.finish_layer(0, h, attn_out)

    dense_s = _median_s(dense, device, repeats)
    attend_s = _median_s(lambda: ops.attend(0, q, kv, kv, plan), device, repeats)
    mean_keys = keys - (rows - 1) / 2
    return StepCost(max(mean_keys * dense_s / max(attend_s, 1e-9), 1.0), dense_s / rows)


def _median_s(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for index in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        if index:  # the first run warms the kernels up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
