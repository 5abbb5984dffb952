"""Who chooses a prompt's recompute ratio and check layers (the request, the engine's setting
or the controller), and what each prefill feeds back to the controller."""

from __future__ import annotations

from dataclasses import dataclass

from engine.blend.controller import Controller
from engine.blend.layout import PromptLayout
from engine.blend.loop import PrefillOutput
from engine.blend.plan import first_streamed_layer
from engine.model.layers import LayerOps
from engine.types import AUTO_RATIO, DEFAULT_RECOMPUTE_RATIO, Mode
from kvstore.loader import KVLayerStream
from kvstore.types import kv_token_bytes


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
        auto_coverage: float = 0.8,
        auto_max_ratio: float = 0.5,
    ):
        self.ops = ops
        self.check_layers = check_layers
        self.controller = controller
        self.recompute_ratio = recompute_ratio
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
            ratio = self.controller.min_ratio
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
        return self._speed_rule(layout, tiers, prefix_cached, self.controller.min_ratio)

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
        """The controller's choice: recompute what loading hides, at least `floor`."""
        num_layers = self.ops.shape.num_layers
        # The fallback reuses the cached prefix too: either way the compute to compare with
        # the loads is that of the other tokens.
        computed = layout.num_tokens - (len(layout.prefix) if prefix_cached else 0)
        decision = self.controller.decide(
            computed, self._layer_bytes(layout.chunks, tiers), num_layers, floor
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
