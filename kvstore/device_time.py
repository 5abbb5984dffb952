"""How long device work took, measured where it runs: CUDA events on a GPU (the host's clock
sees only launches there), time.perf_counter() on the CPU, behind one interface."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

Mark = float | torch.cuda.Event


def mark(device: torch.device, stream: torch.cuda.Stream | None = None) -> Mark:
    """A point in the device's work: on CUDA an event recorded on `stream` (default: the
    current one), after the work launched so far; elsewhere the host's clock now."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


@dataclass(frozen=True)
class DeviceSpan:
    """The device's work between two marks of one stream."""

    start: Mark
    end: Mark

    def seconds(self) -> float | None:
        """Seconds between the marks; None while the device has not reached the end mark
        (never waits for it)."""
        if isinstance(self.start, float) and isinstance(self.end, float):
            return self.end - self.start
        assert isinstance(self.start, torch.cuda.Event) and isinstance(self.end, torch.cuda.Event)
        if not self.end.query():
            return None
        return self.start.elapsed_time(self.end) / 1000.0
