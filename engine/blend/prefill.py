"""One prompt's prefill: open the chunk KV streams, plan from what the store really has (the
ratio from ratio.py), and run the blend layer loop into a KV buffer (again without a bad entry)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from engine.blend.budget import StepBudget
from engine.blend.controller import Controller
from engine.blend.dense import Pausable, run_to_end
from engine.blend.layout import PromptLayout, SaltedChunk
from engine.blend.loop import PrefillOutput, layer_loop
from engine.blend.plan import ChunkSource, PrefillPlan, plan_prefill
from engine.blend.prefix_cache import PrefixCache
from engine.blend.prompt_kv import KVOut
from engine.blend.ratio import RatioChoice, RatioPolicy
from engine.blend.selection import Selection
from engine.blend.timeline import overlap_fraction, total
from engine.model.layers import LayerOps
from engine.types import DEFAULT_RECOMPUTE_RATIO, Blend, GenerateRequest, LayerTimes, Mode, Usage
from kvstore.errors import KVStreamError
from kvstore.loader import KVLayerStream
from kvstore.store import KVStore
from kvstore.types import ChunkKV, chunk_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillAsk:
    """What a prefill is asked: its mode, and of a blend its recompute ratio (None: the
    engine's, or the controller's choice when the engine has none; "auto": the check layer
    chooses, at most `max_recompute_ratio`) and selection (None: the engine's); `token_scores`
    (research: an oracle's, one per blended token) rank the tokens instead."""

    mode: Mode = Mode.CACHEBLEND
    recompute_ratio: float | str | None = None
    selection: Selection | None = None
    max_recompute_ratio: float | None = None
    token_scores: tuple[float, ...] | None = None
    prompt_logprobs: int | None = None  # computed only by a full prefill

    @classmethod
    def of(
        cls, request: GenerateRequest, token_scores: tuple[float, ...] | None = None
    ) -> PrefillAsk:
        """What `request` asks of its prefill."""
        return cls(
            request.mode,
            request.recompute_ratio,
            request.selection,
            request.max_recompute_ratio,
            token_scores,
            request.prompt_logprobs,
        )


@dataclass
class Prefill:
    """A prompt's prefill: what was planned, what it produced, and which chunks had no KV."""

    layout: PromptLayout
    plan: PrefillPlan
    output: PrefillOutput
    blend: Blend
    missing_chunks: list[SaltedChunk]  # with no KV in any tier
    timeline: list[LayerTimes]
    load_bytes_by_tier: dict[str, int]
    chunk_tiers: list[str | None]
    prefill_s: float = 0.0

    @property
    def usage(self) -> Usage:
        plan, selected = self.plan, self.output.num_selected
        blend_tokens = plan.count_tokens(ChunkSource.BLEND)
        return Usage(
            prompt_tokens=plan.num_tokens,
            cached_tokens=(plan.prefix_len if plan.prefix_cached else 0) + blend_tokens - selected,
            recomputed_tokens=plan.count_tokens(ChunkSource.COMPUTE) + selected,
        )

    @property
    def kv_load_s(self) -> float:
        return total(
            (e.load_start_s, e.load_end_s)
            for e in self.timeline
            if e.load_start_s is not None and e.load_end_s is not None
        )

    @property
    def overlap(self) -> float:
        """Fraction of the KV load time hidden behind compute."""
        loads = [
            (e.load_start_s, e.load_end_s)
            for e in self.timeline
            if e.load_start_s is not None and e.load_end_s is not None
        ]
        return overlap_fraction(
            loads, [(e.compute_start_s, e.compute_end_s) for e in self.timeline]
        )


@dataclass(frozen=True)
class _Attempt:
    """A layer loop that ran: its choice, plan and output, what the stream found, and the
    stream it read (`used`) or, in the fallback, left to probe the tiers (`probe`)."""

    choice: RatioChoice
    plan: PrefillPlan
    output: PrefillOutput
    present: list[bool]
    tiers: list[str | None]
    used: KVLayerStream | None = None
    probe: KVLayerStream | None = None


class Prefiller:
    """Builds prompt KV caches over one model and one KV store."""

    def __init__(
        self,
        ops: LayerOps,
        store: KVStore,
        fingerprint: str,
        chunk_prefix: tuple[int, ...],
        check_layers: tuple[int, ...],
        controller: Controller,
        recompute_ratio: float | str | None = None,
        min_ratio: float = DEFAULT_RECOMPUTE_RATIO,
        prefix_cache: PrefixCache | None = None,
        kv_read_delay_s: float = 0.0,
        selection: Selection = Selection.HKVD,
        auto_coverage: float = 0.8,
        auto_max_ratio: float = 0.5,
    ):
        self.ops = ops
        self.store = store
        self.fingerprint = fingerprint
        self.chunk_prefix = chunk_prefix
        self.ratios = RatioPolicy(
            ops, check_layers, controller, recompute_ratio, min_ratio, auto_coverage, auto_max_ratio
        )
        self.prefix_cache = prefix_cache or PrefixCache(0)
        self.kv_read_delay_s = kv_read_delay_s
        self.selection = selection

    @property
    def controller(self) -> Controller:
        return self.ratios.controller

    def chunk_key(self, tokens: tuple[int, ...], cache_salt: str = "") -> str:
        return chunk_key(self.fingerprint, tokens, cache_salt)

    def chunk_keys(self, layout: PromptLayout) -> list[str]:
        return [self.chunk_key(tokens, salt) for tokens, salt in layout.salted_chunks]

    def compute_chunk_kv(self, tokens: tuple[int, ...]) -> ChunkKV:
        """The chunk run alone behind the chunk prefix (BOS); that entry dropped, keys pre-RoPE."""
        return run_to_end(self.chunk_kv_steps(tokens, StepBudget()))

    def chunk_kv_steps(self, tokens: tuple[int, ...], budget: StepBudget) -> Pausable[ChunkKV]:
        """`compute_chunk_kv` in pieces: it pauses where `budget` is spent (engine/background.py
        refills it after each engine step)."""
        boundary = self.chunk_prefix
        plan = PrefillPlan(
            token_ids=boundary + tuple(tokens),
            prefix_len=len(boundary),
            prefix_cached=False,
            chunk_spans=((len(boundary), len(tokens)),),
            chunk_sources=(ChunkSource.COMPUTE,),
            recompute_ratio=1.0,
            check_layers=(),
            keep_pre_rope_keys=True,
        )
        out = yield from layer_loop(self.ops, plan, None, None, None, budget)
        assert out.pre_rope_keys is not None
        start = len(boundary)
        return ChunkKV(
            keys=out.pre_rope_keys[:, :, start:].to("cpu").contiguous(),
            values=out.values[:, :, start:].to("cpu").contiguous(),
        )

    def prefill(
        self,
        layout: PromptLayout,
        ask: PrefillAsk = PrefillAsk(),
        budget: StepBudget | None = None,
        out: KVOut = None,
        opened: KVLayerStream | None = None,
    ) -> Pausable[Prefill]:
        """The one prefill: build the KV cache of a laid-out prompt as `ask` says, into `out`
        when given, pausing whenever the step's `budget` is spent (None: never; drive it whole
        with engine.blend.dense's `run_to_end`, in pieces with `advance`).

        A missing chunk is computed in full; a chunk that turns out bad while streaming is
        dropped and the prefill runs again without it, so a bad entry never fails a request.
        `opened` is the stream `open_ahead` returned for this prompt (the prefill takes it over
        and closes it; a retry opens a fresh one).
        """
        if budget is None:
            budget = StepBudget()
        mode, recompute_ratio = ask.mode, ask.recompute_ratio
        start = time.perf_counter()
        keys = self.chunk_keys(layout)
        reuse = mode is not Mode.FULL_PREFILL
        prefix_kv = self.prefix_cache.get(layout.prefix, layout.cache_salt) if reuse else None
        excluded: set[str] = set()
        while True:
            if opened is None:
                first = self.ratios.first_layer(mode, recompute_ratio, ask.max_recompute_ratio)
                opened = self._open(mode, keys, excluded, first)
            stream, opened = opened, None
            try:
                attempt = yield from self._attempt(layout, ask, prefix_kv, stream, (out, budget))
                break
            except KVStreamError as exc:
                log.warning("recomputing after a KV stream error: %s", exc)
                # A failure not tied to one entry drops every streamed chunk.
                excluded.update(keys if exc.key is None else [exc.key])
            finally:
                if stream is not None:
                    stream.close()
        if reuse and prefix_kv is None and attempt.plan.prefix_len:
            prefix_keys, prefix_values = attempt.output.kv.read(0, attempt.plan.prefix_len)
            computed = ChunkKV(prefix_keys, prefix_values, rotated=True)
            self.prefix_cache.put(layout.prefix, computed, layout.cache_salt)
        self.ratios.observe(layout, attempt.output, attempt.probe, attempt.used)
        return self._report(layout, mode, attempt, start)

    def _attempt(
        self,
        layout: PromptLayout,
        ask: PrefillAsk,
        prefix_kv: ChunkKV | None,
        stream: KVLayerStream | None,
        into: tuple[KVOut, StepBudget],
    ) -> Pausable[_Attempt]:
        """One run of the layer loop over what `stream` found, into `out` under `budget`
        (`into`); KVStreamError when a streamed entry turns out bad."""
        num_chunks = len(layout.chunks)
        present = stream.present if stream is not None else [False] * num_chunks
        tiers: list[str | None] = stream.tiers if stream is not None else [None] * num_chunks
        mode = ask.mode
        choice = self.ratios.choose(
            layout, mode, ask.recompute_ratio, tiers, prefix_kv is not None, ask.max_recompute_ratio
        )
        if choice.full_prefill:
            return (
                yield from self._fallback(layout, choice, prefix_kv, stream, into, present, tiers)
            )
        plan = replace(
            plan_prefill(
                layout,
                mode,
                present,
                prefix_kv is not None,
                choice.recompute_ratio,
                choice.check_layers,
                ask.selection or self.selection,
            ),
            coverage=choice.coverage,
            min_ratio=choice.min_ratio,
            token_scores=ask.token_scores,
            prompt_logprobs=ask.prompt_logprobs,
        )
        used = stream if plan.streamed_chunks else None
        if used is not None:
            used.skip_to(plan.first_streamed_layer)
        prefix = prefix_kv if plan.prefix_cached else None
        output = yield from layer_loop(self.ops, plan, prefix, used, *into)
        return _Attempt(choice, plan, output, present, tiers, used=used)

    def _fallback(
        self,
        layout: PromptLayout,
        choice: RatioChoice,
        prefix_kv: ChunkKV | None,
        stream: KVLayerStream | None,
        into: tuple[KVOut, StepBudget],
        present: list[bool],
        tiers: list[str | None],
    ) -> Pausable[_Attempt]:
        """The controller found blending slower than computing: reuse only the cached prefix.
        `stream` stays unread but open until the compute is done: its loader, already at work,
        probes the tiers off the critical path (the controller learns from it)."""
        plan = plan_prefill(
            layout,
            Mode.PREFIX_CACHE,
            [False] * len(layout.chunks),
            prefix_kv is not None,
            1.0,
            choice.check_layers,
        )
        prefix = prefix_kv if plan.prefix_cached else None
        output = yield from layer_loop(self.ops, plan, prefix, None, *into)
        return _Attempt(choice, plan, output, present, tiers, probe=stream)

    def _report(self, layout: PromptLayout, mode: Mode, attempt: _Attempt, start: float) -> Prefill:
        """The Prefill of the attempt that ran: its blend, missing chunks and timings."""
        plan, used = attempt.plan, attempt.used
        # Only the blending modes stream every chunk, so only they know which had no KV.
        blends = mode in (Mode.CACHEBLEND, Mode.FULL_REUSE)
        missing = [
            c
            for c, found in zip(layout.salted_chunks, attempt.present, strict=True)
            if blends and not found
        ]
        ratio = plan.recompute_ratio
        if plan.coverage is not None:
            blended = plan.count_tokens(ChunkSource.BLEND)
            ratio = attempt.output.num_selected / blended if blended else 0.0
        blend = Blend(
            ratio,
            plan.check_layers[0] if plan.check_layers else 0,
            attempt.choice.chosen_by,
            attempt.choice.full_prefill,
            "oracle" if plan.token_scores is not None else plan.selection.value,
        )
        return Prefill(
            layout,
            plan,
            attempt.output,
            blend,
            missing,
            self._timeline(attempt.output, used, start),
            dict(used.stats.bytes_by_tier) if used is not None else {},
            list(attempt.tiers),
            time.perf_counter() - start,
        )

    def open_ahead(
        self, layout: PromptLayout, ask: PrefillAsk, parked: bool = False
    ) -> KVLayerStream | None:
        """The stream `prefill` would open first for this prompt, opened now: its lookups done
        on the calling thread (a request still queued: `parked`, nothing loads until its
        prefill starts it), or its first layers read by the store's one loader while the
        prompts ahead of it in the step compute."""
        keys = self.chunk_keys(layout)
        first = self.ratios.first_layer(ask.mode, ask.recompute_ratio, ask.max_recompute_ratio)
        return self._open(ask.mode, keys, set(), first, parked)

    def _open(
        self,
        mode: Mode,
        keys: list[str],
        excluded: set[str],
        first_layer: int,
        parked: bool = False,
    ) -> KVLayerStream | None:
        """Streams of every chunk the mode blends (a key in `excluded` counts as absent), from
        `first_layer`; opened before planning, so the loader starts while the plan is made.
        `full_prefill` and `prefix_cache` read no chunk KV."""
        if mode not in (Mode.CACHEBLEND, Mode.FULL_REUSE) or not keys:
            return None
        wanted = [None if key in excluded else key for key in keys]
        return self.store.open_stream(
            wanted,
            device=self.ops.device,
            read_delay_s=self.kv_read_delay_s,
            first_layer=first_layer,
            parked=parked,
        )

    @staticmethod
    def _timeline(
        output: PrefillOutput, stream: KVLayerStream | None, start: float
    ) -> list[LayerTimes]:
        """Seconds since the prefill started, per layer."""
        loads = {t.layer: t for t in stream.timings} if stream is not None else {}
        return [
            LayerTimes(
                c.layer,
                loads[c.layer].load_start_s - start if c.layer in loads else None,
                loads[c.layer].load_end_s - start if c.layer in loads else None,
                c.compute_start_s - start,
                c.compute_end_s - start,
            )
            for c in output.layer_computes
        ]
