"""How many tokens a blend recomputes, decided here alone: who sets the ratio and the check layers
(the request, the engine's setting, the controller's speed rule, or the auto ratio; RatioPolicy),
how many tokens each check layer keeps of it (`tokens_kept`), and what each prefill feeds back
to the controller's estimates."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.blend.controller import Controller
from engine.blend.layout import PromptLayout
from engine.blend.plan import PrefillPlan, first_streamed_layer
from engine.model.layers import LayerOps
from engine.types import AUTO_RATIO, DEFAULT_RECOMPUTE_RATIO, Mode
from kvstore.loader import KVLayerStream
from kvstore.types import kv_token_bytes

if TYPE_CHECKING:  # the loop imports the check layers, which import tokens_kept from here
    from engine.blend.loop import PrefillOutput

# Blend only while loads take less than this share of a layer's compute. Above it a blend
# saves under 20 % (it recomputes r = load / compute of the tokens anyway) while an estimate
# a little low makes it wait on every layer's load, past a full prefill's time (the slow tier
# in docs/benchmarks/kv-pipeline.md).
MAX_LOAD_RATIO = 0.8


@dataclass(frozen=True)
class SpeedDecision:
    recompute_ratio: float
    leading_layers: int  # layers computed fully before the (first) check layer
    full_prefill: bool  # blending would be slower: compute everything, load nothing
    layer_compute_s: float  # estimated full compute of one layer
    layer_load_s: float  # estimated load of one layer of KV


def speed_rule(
    layer_compute_s: float,
    layer_load_s: float,
    num_layers: int,
    min_ratio: float,
    min_leading_layers: int,
) -> SpeedDecision:
    """Blending costs, per layer, max(load time, recompute time): recompute as much as loading
    hides (r = max(r_min, load / compute)), lead with enough full layers that the first blended
    layer's KV has arrived, and give up on blending when loads are the slower (or so close to
    it, MAX_LOAD_RATIO, that a blend saves little and risks much): never slower than a full
    prefill (paper §5)."""
    if layer_compute_s <= 0.0:
        return SpeedDecision(min_ratio, min_leading_layers, False, layer_compute_s, layer_load_s)
    load_ratio = layer_load_s / layer_compute_s
    if load_ratio >= MAX_LOAD_RATIO:
        return SpeedDecision(1.0, num_layers, True, layer_compute_s, layer_load_s)
    leading = min(num_layers - 1, max(min_leading_layers, math.ceil(load_ratio)))
    return SpeedDecision(max(min_ratio, load_ratio), leading, False, layer_compute_s, layer_load_s)


def ratio_schedule(ratio: float, num_checks: int) -> list[float]:
    """Selection ratio at each check layer: halved at each step, ending at `ratio` (paper §4.3).

    One check layer selects `ratio` at once; three select 4r, 2r, then r of the chunk tokens.
    """
    return [min(1.0, ratio * 2 ** (num_checks - 1 - step)) for step in range(num_checks)]


def selection_budget(ratio: float, num_tokens: int) -> int:
    """ceil(ratio * num_tokens), robust to float noise (0.15 * 100 selects 15, not 16)."""
    return min(num_tokens, math.ceil(round(ratio * num_tokens, 6)))


def coverage_budget(mass: torch.Tensor, share: float, low: int, high: int) -> int:
    """The fewest candidates whose `mass` (non-negative) covers `share` of the total, clamped
    to [low, high]: the auto ratio's budget (a flat mass needs many tokens, a peaked one few)."""
    values = mass.float().clamp_min(0).sort(descending=True).values
    total = values.sum()
    covered = values.cumsum(0) >= share * total * (1 - 1e-6)
    # One read-back: the count, or `low` where there is no mass to cover.
    needed = int(torch.where(total > 0, covered.to(torch.int8).argmax() + 1, low))
    return max(low, min(high, needed))


def tokens_kept(
    plan: PrefillPlan,
    check: int,
    num_checks: int,
    num_blended: int,
    mass: Callable[[], torch.Tensor],
) -> int:
    """How many of the `num_blended` tokens check layer `check` (of `num_checks`, in order)
    keeps: its share of the plan's ratio (`ratio_schedule`) as a count; under the auto ratio
    (`plan.coverage`) the fewest that cover that share of the selection's `mass` (called only
    then), at least `plan.min_ratio`'s count."""
    budget = selection_budget(ratio_schedule(plan.recompute_ratio, num_checks)[check], num_blended)
    if plan.coverage is None:
        return budget
    low = min(budget, selection_budget(plan.min_ratio, num_blended))
    return coverage_budget(mass(), plan.coverage, low, budget)


@dataclass(frozen=True)
class RatioChoice:
    recompute_ratio: float
    check_layers: tuple[int, ...]
    chosen_by: str  # "request", "engine", "controller" or "auto"
    full_prefill: bool = False  # the controller found blending slower than a full prefill
    # The auto ratio: recompute_ratio is its bound, the check layer keeps what covers this
    # share of the selection's mass, and at least min_ratio (what loading hides anyway).
    coverage: float | None = None
    min_ratio: float = 0.0


class RatioPolicy:
    def __init__(
        self,
        ops: LayerOps,
        check_layers: tuple[int, ...],
        controller: Controller,
        recompute_ratio: float | str | None,
        min_ratio: float = DEFAULT_RECOMPUTE_RATIO,
        auto_coverage: float = 0.8,
        auto_max_ratio: float = 0.5,
    ):
        self.ops = ops
        self.check_layers = check_layers
        self.controller = controller
        self.recompute_ratio = recompute_ratio
        self.min_ratio = min_ratio  # the speed rule's floor
        self.auto_coverage = auto_coverage
        self.auto_max_ratio = auto_max_ratio

    def first_layer(
        self, mode: Mode, requested: float | str | None, max_ratio: float | None = None
    ) -> int:
        """The lowest layer the plan can read from the stream, known before it is made: the
        controller's ratio is at least its floor, and its check layers only move up."""
        ratio = requested if requested is not None else self.recompute_ratio
        if ratio == AUTO_RATIO:
            ratio = self.auto_max_ratio if max_ratio is None else max_ratio
        if ratio is None:
            ratio = self.min_ratio
        assert isinstance(ratio, float | int)
        return first_streamed_layer(ratio if mode is Mode.CACHEBLEND else 0.0, self.check_layers)

    def choose(
        self,
        layout: PromptLayout,
        mode: Mode,
        requested: float | str | None,
        tiers: list[str | None],
        prefix_cached: bool,
        max_ratio: float | None = None,
    ) -> RatioChoice:
        """The recompute ratio, the check layers and who chose them: the request, the engine's
        setting, or (neither given, cacheblend, something cached) the controller. The auto
        ratio (asked by the request or set for the engine) is bounded by `max_ratio` (None:
        the engine's auto_max_ratio) and by the controller's speed rule from below."""
        if requested is None and self.recompute_ratio == AUTO_RATIO:
            requested = AUTO_RATIO
        if requested == AUTO_RATIO:
            return self._auto(layout, mode, tiers, prefix_cached, max_ratio)
        if requested is not None:
            assert isinstance(requested, float | int)
            return RatioChoice(requested, self.check_layers, "request")
        if self.recompute_ratio is not None:
            assert isinstance(self.recompute_ratio, float | int)
            return RatioChoice(self.recompute_ratio, self.check_layers, "engine")
        if mode is not Mode.CACHEBLEND or not any(tiers):
            return RatioChoice(DEFAULT_RECOMPUTE_RATIO, self.check_layers, "engine")
        return self._speed_rule(layout, tiers, prefix_cached, self.min_ratio)

    def _auto(
        self,
        layout: PromptLayout,
        mode: Mode,
        tiers: list[str | None],
        prefix_cached: bool,
        max_ratio: float | None,
    ) -> RatioChoice:
        bound = self.auto_max_ratio if max_ratio is None else max_ratio
        checks, low = self.check_layers, 0.0
        if mode is Mode.CACHEBLEND and any(tiers):
            speed = self._speed_rule(layout, tiers, prefix_cached, 0.0)
            if speed.full_prefill:
                return speed
            checks, low = speed.check_layers, speed.recompute_ratio
        return RatioChoice(bound, checks, "auto", coverage=self.auto_coverage, min_ratio=low)

    def _speed_rule(
        self, layout: PromptLayout, tiers: list[str | None], prefix_cached: bool, floor: float
    ) -> RatioChoice:
        """The speed rule over the controller's estimates: recompute what loading hides, at
        least `floor`."""
        num_layers = self.ops.shape.num_layers
        # The fallback reuses the cached prefix too: either way the compute to compare with
        # the loads is that of the other tokens.
        computed = layout.num_tokens - (len(layout.prefix) if prefix_cached else 0)
        layer = self.controller.estimate(computed, self._layer_bytes(layout.chunks, tiers))
        decision = speed_rule(
            layer.compute_s, layer.load_s, num_layers, floor, self.check_layers[0]
        )
        shift = decision.leading_layers - self.check_layers[0]
        checks = tuple(c + shift for c in self.check_layers if c + shift < num_layers)
        return RatioChoice(
            decision.recompute_ratio,
            checks or (decision.leading_layers,),
            "controller",
            decision.full_prefill,
        )

    def _layer_bytes(
        self, chunks: tuple[tuple[int, ...], ...], tiers: list[str | None]
    ) -> dict[str, int]:
        """Bytes of one layer of the chunks' KV per tier they are read from, as the model
        holds it (the unit of the controller's estimates, whatever a tier stores)."""
        shape = self.ops.shape
        token_bytes = kv_token_bytes(shape.num_kv_heads, shape.head_dim, self.ops.dtype)
        layer_bytes: dict[str, int] = {}
        for tokens, tier in zip(chunks, tiers, strict=True):
            if tier is not None:
                layer_bytes[tier] = layer_bytes.get(tier, 0) + token_bytes * len(tokens)
        return layer_bytes

    def observe(
        self,
        layout: PromptLayout,
        output: PrefillOutput,
        probe: KVLayerStream | None,
        used: KVLayerStream | None,
    ) -> None:
        """Feed the controller what this prefill measured where the work ran: the loader's
        time per layer of the fallback's probe or of the stream the layer loop read (over
        every chunk), and the time of the layers computed for every token, those timed alone
        only (a layer that shared its forward with other prefills or decode rows, or paused
        for other work, timed theirs too)."""
        if probe is not None:
            self._observe_stream(layout.chunks, probe, probe=True)
        if used is not None:
            self._observe_stream(layout.chunks, used, probe=False)
        widest = max((c.num_tokens for c in output.layer_computes), default=0)
        for c in output.layer_computes:
            if c.num_tokens == widest and c.alone and c.device is not None:
                self.controller.observe_compute(c.num_tokens, c.device.seconds)

    def _observe_stream(
        self, chunks: tuple[tuple[int, ...], ...], stream: KVLayerStream, probe: bool
    ) -> None:
        """The layers a (closed) stream loaded, whether or not they were read."""
        timings = list(stream.timings)
        if not timings:
            return

        def seconds() -> float | None:
            each = [t.seconds() for t in timings]
            return None if None in each else sum(s for s in each if s is not None)

        layers = len(timings)
        self.controller.observe_load(
            {t: n * layers for t, n in self._layer_bytes(chunks, stream.tiers).items()},
            seconds,
            probe,
        )
