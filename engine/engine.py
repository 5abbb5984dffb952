"""The engine's Python API: load a model, precompute chunk KV, answer requests by blending.

Model work runs on one worker thread; `stream()` bridges it to asyncio for the services.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

from engine.blend import PrefillOutput, PrefixKV, run_prefill
from engine.controller import Controller, Decision
from engine.decode import Decoder, eos_token_ids, to_dynamic_cache
from engine.errors import PromptTooLongError
from engine.layers import LayerRunner
from engine.model import LoadedModel, load_model
from engine.plan import ChunkSource, PrefillPlan, plan_prefill
from engine.prefix_cache import PrefixCache
from engine.prompt import PromptBuilder, PromptLayout
from engine.sampling import Sampler
from engine.streaming import Generation
from engine.timeline import overlap_fraction, total
from engine.types import (
    DEFAULT_RECOMPUTE_RATIO,
    Blend,
    Chunk,
    GenerateRequest,
    GenerateResult,
    LayerTimes,
    Mode,
    PrecomputeResult,
    Timings,
    TokenDelta,
    Usage,
)
from engine.worker import Priority, Worker
from kvstore.errors import KVStreamError
from kvstore.store import KVStore, KVStoreConfig
from kvstore.types import ChunkKV, chunk_key

log = logging.getLogger(__name__)


@dataclass
class Prefill:
    """A prompt's prefill: what was planned, what it produced, and which chunks had no KV."""

    layout: PromptLayout
    plan: PrefillPlan
    output: PrefillOutput
    missing_chunks: list[tuple[int, ...]]
    decision: Decision | None
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
            cached_tokens=(plan.prefix_len if plan.prefix_cached else 0)
            + plan.count_tokens(ChunkSource.EXACT)
            + blend_tokens
            - selected,
            recomputed_tokens=plan.count_tokens(ChunkSource.COMPUTE) + selected,
        )

    @property
    def kv_load_s(self) -> float:
        return total(
            (e.load_start_s, e.load_end_s) for e in self.timeline if e.load_start_s is not None
        )

    @property
    def overlap(self) -> float:
        """Fraction of the KV load time hidden behind compute."""
        loads = [
            (e.load_start_s, e.load_end_s) for e in self.timeline if e.load_start_s is not None
        ]
        return overlap_fraction(
            loads, [(e.compute_start_s, e.compute_end_s) for e in self.timeline]
        )


class Engine:
    """CacheBlend over one Hugging Face model and one KV store."""

    def __init__(
        self,
        loaded: LoadedModel,
        store: KVStore,
        *,
        check_layers: tuple[int, ...] = (1,),
        recompute_ratio: float | None = None,
        min_recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
        system_prompt: str | None = None,
        prefix_cache_entries: int = 16,
        max_waiting: int = 64,
        kv_read_delay_s: float = 0.0,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.store = store
        self.runner = LayerRunner(self.model)
        num_layers = self.runner.shape.num_layers
        check_layers = tuple(sorted(set(check_layers))) or (min(1, num_layers - 1),)
        if not all(0 <= layer < num_layers for layer in check_layers):
            raise ValueError(f"check layers {check_layers} outside the model's 0..{num_layers - 1}")
        self.check_layers = check_layers
        self.recompute_ratio = recompute_ratio
        self.kv_read_delay_s = kv_read_delay_s
        self.controller = Controller(min_recompute_ratio, min_leading_layers=check_layers[0])
        self.prompts = PromptBuilder(
            self.tokenizer, **({"default_system": system_prompt} if system_prompt else {})
        )
        self.prefix_cache = PrefixCache(prefix_cache_entries)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.worker = Worker(max_waiting)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        device: str = "cpu",
        dtype: str = "float32",
        store: KVStore | None = None,
        **options,
    ) -> Engine:
        """Load `path` (checkpoint directory or cached hub id); the default store is memory-only."""
        loaded = load_model(path, device=device, dtype=dtype)
        if store is None:
            store = KVStore(
                KVStoreConfig(
                    model_fingerprint=loaded.fingerprint, pin_memory=loaded.device.type == "cuda"
                )
            )
        return cls(loaded, store, **options)

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    @property
    def device(self):
        return self.loaded.device

    def chunk_key(self, tokens: tuple[int, ...]) -> str:
        return chunk_key(self.fingerprint, tokens)

    # -- chunk KV ------------------------------------------------------------------------------

    def precompute(self, chunks: Iterable[Chunk | str]) -> PrecomputeResult:
        """Compute and store the standalone KV of every chunk not already in the store."""
        chunks = list(chunks)
        return self.worker.submit(lambda: self._precompute(chunks), Priority.BACKGROUND).result()

    def _precompute(self, chunks: list[Chunk | str]) -> PrecomputeResult:
        result = PrecomputeResult()
        for chunk in chunks:
            text = chunk.text if isinstance(chunk, Chunk) else chunk
            tokens = self.prompts.chunk_tokens(text)
            key = self.chunk_key(tokens)
            if self.store.lookup([key])[0] is not None:
                result.skipped += 1
                continue
            kv = self.compute_chunk_kv(tokens)
            self.store.put(key, kv)
            result.stored += 1
            result.bytes += kv.nbytes
        return result

    def compute_chunk_kv(self, tokens: tuple[int, ...]) -> ChunkKV:
        """The chunk run alone behind the chunk prefix (BOS); that entry dropped, keys pre-RoPE."""
        boundary = self.prompts.chunk_prefix
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
        out = run_prefill(self.runner, plan)
        start = len(boundary)
        return ChunkKV(
            keys=out.pre_rope_keys[:, :, start:].to("cpu").contiguous(),
            values=out.values[:, :, start:].to("cpu").contiguous(),
        )

    # -- prefill -------------------------------------------------------------------------------

    def layout(self, request: GenerateRequest) -> PromptLayout:
        layout = self.prompts.build(
            request.question, [c.text for c in request.chunks], request.system
        )
        limit = self.runner.max_positions
        if limit and layout.num_tokens + request.max_tokens > limit:
            raise PromptTooLongError(
                f"prompt has {layout.num_tokens} tokens and max_tokens is {request.max_tokens}: "
                f"more than the model's maximum of {limit} positions"
            )
        return layout

    def prefill(self, request: GenerateRequest) -> Prefill:
        """Lay out the request's prompt and build its KV cache in the request's mode."""
        start = time.perf_counter()
        prefill = self.prefill_layout(self.layout(request), request.mode, request.recompute_ratio)
        prefill.prefill_s = time.perf_counter() - start
        return prefill

    def prefill_layout(
        self, layout: PromptLayout, mode: Mode, recompute_ratio: float | None = None
    ) -> Prefill:
        """Build the KV cache of a laid-out prompt.

        `recompute_ratio=None` takes the engine's ratio, or the controller's choice when the
        engine has none. A chunk that is missing, or turns out bad while streaming, is computed
        in full; the prefill is then retried without it, so a bad entry never fails a request.
        """
        start = time.perf_counter()
        keys = [self.chunk_key(tokens) for tokens in layout.chunks]
        reuse = mode is not Mode.FULL_PREFILL
        tiers = self.store.lookup(keys) if reuse and keys else [None] * len(keys)
        found = list(tiers)
        prefix_kv = self.prefix_cache.get(layout.prefix) if reuse else None
        while True:
            ratio, check_layers, decision = self._choose(
                layout, mode, recompute_ratio, tiers, prefix_kv is not None
            )
            # The controller's fallback is a true full prefill: with every position computed,
            # the plain causal kernel beats any reuse.
            fallback = decision is not None and decision.full_prefill
            plan = plan_prefill(
                layout,
                Mode.FULL_PREFILL if fallback else mode,
                [t is not None for t in tiers],
                prefix_kv is not None,
                self.prompts.chunk_prefix,
                ratio,
                check_layers,
            )
            streamed = plan.streamed_chunks
            stream = (
                self.store.open_stream(
                    [keys[j] for j in streamed],
                    device=self.device,
                    read_delay_s=self.kv_read_delay_s,
                )
                if streamed
                else None
            )
            try:
                if stream is not None and not all(stream.present):
                    for j, present in zip(streamed, stream.present, strict=True):
                        tiers[j] = tiers[j] if present else None
                    continue
                output = run_prefill(
                    self.runner, plan, prefix_kv if plan.prefix_cached else None, stream
                )
            except KVStreamError as exc:
                log.warning("recomputing after a KV stream error: %s", exc)
                failed = [j for j in streamed if keys[j] == exc.key] or streamed
                for j in failed:
                    tiers[j] = None
                continue
            finally:
                if stream is not None:
                    stream.close()
            break
        loads = {t.layer: t for t in stream.timings} if stream is not None else {}
        # Seconds since this prefill started, per layer.
        timeline = [
            LayerTimes(
                c.layer,
                None if c.layer not in loads else loads[c.layer].load_start_s - start,
                None if c.layer not in loads else loads[c.layer].load_end_s - start,
                c.compute_start_s - start,
                c.compute_end_s - start,
            )
            for c in output.layer_computes
        ]
        load_bytes = dict(stream.stats.bytes_by_tier) if stream is not None else {}
        self._observe(output, stream)
        if reuse and prefix_kv is None:
            end = plan.prefix_len
            self.prefix_cache.put(
                layout.prefix,
                PrefixKV(output.keys[:, :, :end].clone(), output.values[:, :, :end].clone()),
            )
        missing = [layout.chunks[j] for j, tier in enumerate(tiers) if reuse and tier is None]
        return Prefill(
            layout,
            plan,
            output,
            missing,
            decision,
            timeline,
            load_bytes,
            found,
            time.perf_counter() - start,
        )

    def _choose(
        self,
        layout: PromptLayout,
        mode: Mode,
        requested: float | None,
        tiers: list[str | None],
        prefix_cached: bool,
    ) -> tuple[float, tuple[int, ...], Decision | None]:
        """The recompute ratio and check layers: as asked, configured, or from the controller."""
        ratio = requested if requested is not None else self.recompute_ratio
        if mode is not Mode.CACHEBLEND or ratio is not None or not any(tiers):
            return (DEFAULT_RECOMPUTE_RATIO if ratio is None else ratio), self.check_layers, None
        shape = self.runner.shape
        token_bytes = 2 * shape.num_kv_heads * shape.head_dim * self.runner.dtype.itemsize
        layer_bytes: dict[str, int] = {}
        for tokens, tier in zip(layout.chunks, tiers, strict=True):
            if tier is not None:
                layer_bytes[tier] = layer_bytes.get(tier, 0) + token_bytes * len(tokens)
        computed = layout.num_tokens - (len(layout.prefix) if prefix_cached else 0)
        decision = self.controller.decide(computed, layer_bytes, shape.num_layers)
        shift = decision.leading_layers - self.check_layers[0]
        checks = tuple(c + shift for c in self.check_layers if c + shift < shape.num_layers)
        return decision.recompute_ratio, checks or (decision.leading_layers,), decision

    def _observe(self, output: PrefillOutput, stream) -> None:
        """Feed the controller what this prefill measured: the loader's wall time per layer
        (what the pipeline waits on, a mixed stream counted as its slowest tier) and the time
        of the layers computed for every token."""
        if stream is not None and stream.timings:
            tier = "ssd" if "ssd" in stream.tiers else "memory"
            self.controller.observe_load(
                tier,
                sum(t.bytes_loaded for t in stream.timings),
                sum(t.load_end_s - t.load_start_s for t in stream.timings),
            )
        widest = max((c.num_tokens for c in output.layer_computes), default=0)
        for c in output.layer_computes:
            if c.num_tokens == widest:
                self.controller.observe_compute(c.num_tokens, c.compute_end_s - c.compute_start_s)

    # -- generation ----------------------------------------------------------------------------

    def iter_generate(
        self, request: GenerateRequest, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[TokenDelta | GenerateResult]:
        """Token deltas, then the GenerateResult; then writes back the KV of uncached chunks.

        Raises GenerationCancelled between tokens once `cancelled()` is true.
        """
        start = time.perf_counter()
        prefill = self.prefill(request)
        decoder = Decoder(self.model, self.tokenizer, set() if request.ignore_eos else self.eos_ids)
        cache = to_dynamic_cache(self.model, prefill.output.keys, prefill.output.values)
        sampler = Sampler(request.temperature, request.top_p, request.seed)
        decode_start = time.perf_counter()
        yield from decoder.run(
            cache, prefill.output.logits, sampler, request.max_tokens, request.stop, cancelled
        )
        end = time.perf_counter()
        usage = prefill.usage
        usage.completion_tokens = len(decoder.text.token_ids)
        computes = prefill.output.layer_computes
        yield GenerateResult(
            text=decoder.text.text,
            finish_reason=decoder.finish_reason,
            usage=usage,
            timings=Timings(
                ttft_s=(decoder.first_token_at or end) - start,
                prefill_s=prefill.prefill_s,
                kv_load_s=prefill.kv_load_s,
                kv_wait_s=prefill.output.kv_wait_s,
                recompute_s=sum(c.compute_end_s - c.compute_start_s for c in computes),
                decode_s=end - decode_start,
                total_s=end - start,
                overlap=prefill.overlap,
            ),
            blend=self._blend_report(request, prefill),
            token_ids=list(decoder.text.token_ids),
            layers=prefill.timeline,
            chunk_tiers=prefill.chunk_tiers,
            load_bytes_by_tier=prefill.load_bytes_by_tier,
        )
        for tokens in prefill.missing_chunks:
            self.worker.submit(functools.partial(self._write_back, tokens), Priority.BACKGROUND)

    def _blend_report(self, request: GenerateRequest, prefill: Prefill) -> Blend:
        plan, decision = prefill.plan, prefill.decision
        leading = plan.check_layers[0] if plan.check_layers else 0
        if decision is not None:
            return Blend(plan.recompute_ratio, leading, "controller", decision.full_prefill)
        chosen_by = "request" if request.recompute_ratio is not None else "engine"
        return Blend(plan.recompute_ratio, leading, chosen_by)

    def _write_back(self, tokens: tuple[int, ...]) -> None:
        key = self.chunk_key(tokens)
        if self.store.lookup([key])[0] is None:
            self.store.put(key, self.compute_chunk_kv(tokens))

    def generate(self, request: GenerateRequest) -> GenerateResult:
        """Answer one request synchronously on the worker thread."""
        return self.worker.submit(lambda: self._collect(request)).result()

    def _collect(self, request: GenerateRequest) -> GenerateResult:
        *_, result = self.iter_generate(request)
        assert isinstance(result, GenerateResult)
        return result

    def start(self, request: GenerateRequest) -> Generation:
        """Queue a generation; iterate the returned object from the event loop.

        Raises QueueFullError when the worker's wait line is full.
        """
        return Generation(self.worker, lambda cancelled: self.iter_generate(request, cancelled))

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta | GenerateResult]:
        """Token deltas then the result; leaving the loop early cancels the generation."""
        async for event in self.start(request):
            yield event

    async def aprecompute(self, chunks: Iterable[Chunk | str]) -> PrecomputeResult:
        """Precompute chunk by chunk as background work: a waiting generation goes first."""
        parts = await asyncio.gather(
            *(
                self.worker.run(functools.partial(self._precompute, [chunk]), Priority.BACKGROUND)
                for chunk in chunks
            )
        )
        return PrecomputeResult(
            stored=sum(p.stored for p in parts),
            skipped=sum(p.skipped for p in parts),
            bytes=sum(p.bytes for p in parts),
        )

    def drain(self) -> None:
        """Wait for queued background work (precompute, KV write-back) to finish."""
        self.worker.drain()

    def close(self) -> None:
        self.worker.close()
