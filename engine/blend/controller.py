"""Chooses the recompute ratio and the leading full layers from measured speeds (paper §5).

Blending costs, per layer, max(load time, recompute time); the controller recomputes as much
as loading hides (r = max(r_min, load / compute)) and falls back to full prefill when loading a
layer takes longer than computing it (with a margin: from 0.8 of it), so blending is never
slower than full prefill.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.types import DEFAULT_RECOMPUTE_RATIO
from kvstore import tiers

# Weight of a load faster than the estimate, and of every compute measurement.
_EWMA = 0.3
# Measurements waiting for the device to finish the work they time, at most (the oldest go).
MAX_PENDING = 256

# A measurement: its seconds now, or a callable giving them once the device is done (None
# until then: CUDA events are read without waiting for them).
Seconds = float | Callable[[], float | None]
# Blend only while loads take less than this share of a layer's compute. Above it a blend
# saves under 20 % (it recomputes r = load / compute of the tokens anyway) while an estimate
# a little low makes it wait on every layer's load: measured on the 2-core CPU, blends at
# r ≈ 0.98 from a slow tier took 1.4 x a full prefill.
MAX_LOAD_RATIO = 0.8


@dataclass(frozen=True)
class Decision:
    recompute_ratio: float
    leading_layers: int  # layers computed fully before the (first) check layer
    full_prefill: bool  # blending would be slower: compute everything, load nothing
    layer_compute_s: float  # estimated full compute of one layer
    layer_load_s: float  # estimated load of one layer of KV


def decide(
    layer_compute_s: float,
    layer_load_s: float,
    num_layers: int,
    min_ratio: float,
    min_leading_layers: int,
) -> Decision:
    """The pure rule: recompute what loading hides, lead with enough full layers that the
    first blended layer's KV has arrived, and give up on blending when loads are the slower
    (or so close to it, MAX_LOAD_RATIO, that a blend saves little and risks much)."""
    if layer_compute_s <= 0.0:
        return Decision(min_ratio, min_leading_layers, False, layer_compute_s, layer_load_s)
    load_ratio = layer_load_s / layer_compute_s
    if load_ratio >= MAX_LOAD_RATIO:
        return Decision(1.0, num_layers, True, layer_compute_s, layer_load_s)
    leading = min(num_layers - 1, max(min_leading_layers, math.ceil(load_ratio)))
    return Decision(max(min_ratio, load_ratio), leading, False, layer_compute_s, layer_load_s)


class Controller:
    """Keeps an estimate of the load time per byte of each tier and of the compute time per
    token-layer, and turns them into a Decision per prompt. Thread-safe.

    Load estimates are seconds per byte, not bytes per second: a layer waits on a load time,
    and only an average of times lets one slow read weigh what it costs (averaging speeds, a
    read 2000x slower moves the estimate by 43%, and the next fast read erases it).

    A read slower than the estimate replaces it; a faster one moves it by 30%. Underestimating
    a tier costs every request that blends on it load / compute times a full prefill, while
    overestimating it costs one fallback (at most a full prefill), whose probe then measures the
    tier again: see `observe_load`.

    Times are measured where the work runs (kvstore/device_time.py: CUDA events on a GPU); a
    measurement whose device work is not finished yet waits, and counts once it is (checked,
    never waited for, at each observation and decision).
    """

    def __init__(self, min_ratio: float = DEFAULT_RECOMPUTE_RATIO, min_leading_layers: int = 1):
        self.min_ratio = min_ratio
        self.min_leading_layers = min_leading_layers
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

    def decide(
        self,
        num_tokens: int,
        layer_bytes_by_tier: dict[str, int],
        num_layers: int,
        min_ratio: float | None = None,
    ) -> Decision:
        """Ratio and leading layers for a prompt whose full prefill computes `num_tokens` tokens
        (what no cache holds exactly) and whose chunk KV takes `layer_bytes_by_tier` bytes per
        layer; the ratio is at least `min_ratio` (None: the controller's floor)."""
        floor = self.min_ratio if min_ratio is None else min_ratio
        with self._lock:
            self._settle()
            compute_s = (self.token_layer_s or 0.0) * num_tokens
            load_s = sum(n * self._estimate(tier) for tier, n in layer_bytes_by_tier.items())
        return decide(compute_s, load_s, num_layers, floor, self.min_leading_layers)

    def _estimate(self, tier: str) -> float:
        """Seconds per byte of `tier`; a tier never heard of counts as the slowest known."""
        return self.seconds_per_byte.get(tier, max(self.seconds_per_byte.values()))
