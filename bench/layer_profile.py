"""Where the blend layer loop spends its time: the LayerOps's parts timed per prefill
(projections, RoPE, attention, output projection + MLP); the rest is KV assembly and selection."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

from engine.model.layers import LayerOps

# LayerOps method -> the part of the layer loop it is.
PARTS = {
    "project_qkv": "qkv proj",
    "rotate": "rope",
    "attend": "attention",
    "finish_layer": "o proj + mlp",
}


class LayerProfile:
    """Wraps one LayerOps's parts with timers; `take()` returns and resets the seconds."""

    def __init__(self, ops: LayerOps, device: torch.device):
        self.seconds: dict[str, float] = defaultdict(float)
        for method, part in PARTS.items():
            setattr(ops, method, self._timed(getattr(ops, method), part, device))

    def _timed(self, method: Callable, part: str, device: torch.device) -> Callable:
        def run(*args, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.seconds[part] += time.perf_counter() - start
            return result

        return run

    def take(self, total_s: float) -> dict[str, float]:
        """The parts' seconds since the last take, plus `other`: total_s minus their sum."""
        parts = {part: self.seconds.get(part, 0.0) for part in PARTS.values()}
        parts["other"] = total_s - sum(parts.values())
        self.seconds.clear()
        return parts
