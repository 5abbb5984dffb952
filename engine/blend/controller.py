"""Estimates, from measured speeds, what a prompt's layer costs: its full compute and the load
of its chunks' KV from their tiers (paper §5). The rule that turns them into a recompute ratio
is ratio.py's `speed_rule`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore import tiers

# Weight of a load faster than the estimate, and of every compute measurement.
_EWMA = 0.3
# Measurements waiting for the device to finish the work they time, at most (the oldest go).
MAX_PENDING = 256

# A measurement: its seconds now, or a callable giving them once the device is done (None
# until then: CUDA events are read without waiting for them).
Seconds = float | Callable[[], float | None]


@dataclass(frozen=True)
class LayerEstimate:
    """What one layer of a prompt is expected to take: its full compute, and the load of its
    chunks' KV from the tiers they are in."""

    compute_s: float
    load_s: float


class Controller:
    """Keeps an estimate of the load time per byte of each tier and of the compute time per
    token-layer, and what a prompt's layer takes by them (`estimate`). Thread-safe.

    Load estimates are seconds per byte, not bytes per second: a layer waits on a load time,
    and only an average of times lets one slow read weigh what it costs (averaging speeds, a
    read 2000x slower moves the estimate by 43%, and the next fast read erases it).

    A read slower than the estimate replaces it; a faster one moves it by 30%. Underestimating
    a tier costs every request that blends on it load / compute times a full prefill, while
    overestimating it costs one fallback (at most a full prefill), whose probe then measures the
    tier again: see `observe_load`.

    Times are measured where the work runs (kvstore/device_time.py: CUDA events on a GPU); a
    measurement whose device work is not finished yet waits, and counts once it is (checked,
    never waited for, at each observation and estimate).
    """

    def __init__(self) -> None:
        self.seconds_per_byte = {tier: 1.0 / bps for tier, bps in tiers.PRIOR_BYTES_PER_S.items()}
        self._measured: set[str] = set()  # tiers whose estimate is a measurement, not the prior
        self.token_layer_s: float | None = None
        self._pending: list[tuple[Callable[[], float | None], Callable[[float], None]]] = []
        self._lock = threading.Lock()

    def _take(self, seconds: Seconds, apply: Callable[[float], None]) -> None:
        """Apply a measurement now, or once its device work is done (lock held)."""
        if callable(seconds):
            self._pending.append((seconds, apply))
            del self._pending[:-MAX_PENDING]
        else:
            apply(seconds)
        self._settle()

    def _settle(self) -> None:
        """Apply the pending measurements whose device work is done, in order (lock held)."""
        waiting = []
        for seconds, apply in self._pending:
            value = seconds()
            if value is None:
                waiting.append((seconds, apply))
            else:
                apply(value)
        self._pending = waiting

    def observe_load(
        self, bytes_by_tier: dict[str, int], seconds: Seconds, probe: bool = False
    ) -> None:
        """`bytes_by_tier` loaded in `seconds` of loader time (several layers, one stream).

        `probe`: read while the controller had these tiers in fallback. Their estimate then
        dates from before the fallback, and nothing else reads them, so the probe replaces it:
        one fast probe lets the next request blend again.

        A stream of several tiers is timed as a whole: the slowest tier gets the time the
        others' estimates leave over (at least its share by bytes), the others are not updated.
        """
        loaded = {tier: n for tier, n in bytes_by_tier.items() if n > 0}
        if loaded:
            with self._lock:
                self._take(seconds, lambda s: self._apply_load(loaded, s, probe))

    def _apply_load(self, loaded: dict[str, int], seconds: float, probe: bool) -> None:
        if seconds > 0.0:
            slowest = tiers.slowest(list(loaded))
            assert slowest is not None
            others_s = sum(
                n * self._estimate(tier) for tier, n in loaded.items() if tier != slowest
            )
            share_s = seconds * loaded[slowest] / sum(loaded.values())
            measured = max(seconds - others_s, share_s) / loaded[slowest]
            previous = self._estimate(slowest)
            if probe or slowest not in self._measured or measured > previous:
                self.seconds_per_byte[slowest] = measured
            else:
                self.seconds_per_byte[slowest] = (1 - _EWMA) * previous + _EWMA * measured
            self._measured.add(slowest)

    def observe_compute(self, num_tokens: int, seconds: Seconds) -> None:
        """One layer computed for `num_tokens` tokens in `seconds` (of that work alone)."""
        if num_tokens < 16:
            return  # tiny layers are dominated by overheads, not by tokens
        with self._lock:
            self._take(seconds, lambda s: self._apply_compute(num_tokens, s))

    def _apply_compute(self, num_tokens: int, seconds: float) -> None:
        if seconds > 0.0:
            measured = seconds / num_tokens
            previous = self.token_layer_s
            self.token_layer_s = (
                measured if previous is None else (1 - _EWMA) * previous + _EWMA * measured
            )

    def estimate(self, num_tokens: int, layer_bytes_by_tier: dict[str, int]) -> LayerEstimate:
        """One layer of a prompt whose full prefill computes `num_tokens` tokens (what no cache
        holds exactly) and whose chunk KV takes `layer_bytes_by_tier` bytes per layer."""
        with self._lock:
            self._settle()
            compute_s = (self.token_layer_s or 0.0) * num_tokens
            load_s = sum(n * self._estimate(tier) for tier, n in layer_bytes_by_tier.items())
        return LayerEstimate(compute_s, load_s)

    def _estimate(self, tier: str) -> float:
        """Seconds per byte of `tier`; a tier never heard of counts as the slowest known."""
        return self.seconds_per_byte.get(tier, max(self.seconds_per_byte.values()))
