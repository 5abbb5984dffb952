"""The engine's Python API: load a model, precompute chunk KV, serve many requests at once.

A thin front over the serving core: the scheduler picks each step's sequences, the prefiller
blends their prompts into KV-pool slots, the runner decodes every running sequence as one
batch. All model work runs on the worker thread; `start()` bridges it to asyncio.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import torch

from engine.controller import Controller
from engine.decode import eos_token_ids
from engine.detokenize import IncrementalText
from engine.errors import ChunkTooLongError, GenerationCancelled, PromptTooLongError
from engine.estimate import QueueEstimate
from engine.layers import LayerRunner
from engine.model import LoadedModel, load_model
from engine.prefill import Prefill, Prefiller
from engine.prefix_cache import PrefixCache
from engine.prompt import PromptBuilder, PromptLayout
from engine.runner import ModelRunner
from engine.sampling import Sampler
from engine.scheduler import Scheduler
from engine.selection import Selection
from engine.sequence import Event, Sequence
from engine.shadow import Shadow, ShadowConfig
from engine.slots import SlotTable
from engine.streaming import Generation
from engine.types import (
    DEFAULT_RECOMPUTE_RATIO,
    NO_PENALTIES,
    Chunk,
    ChunkOrder,
    ChunkWrite,
    GenerateRequest,
    GenerateResult,
    Mode,
    Penalties,
    PrecomputeResult,
    Timings,
    TokenDelta,
)
from engine.worker import Worker
from kvstore.loader import KVLayerStream
from kvstore.store import KVStore, KVStoreConfig

log = logging.getLogger(__name__)

# Positions per sequence when neither the setting nor the model bounds them.
DEFAULT_MAX_MODEL_LEN = 8192


def available_ram_bytes() -> int:
    """MemAvailable (free plus reclaimable cache), or the free pages where /proc is absent."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for metrics: prefill or decode, sequences, tokens fed, seconds."""

    is_prefill: bool
    num_seqs: int
    num_tokens: int
    seconds: float


class Engine:
    """CacheBlend over one Hugging Face model and one KV store, serving many requests at once.

    `max_num_seqs` sequences run together, each in a KV slot of `max_model_len` positions
    (default: the model's, at most 8192); `kv_pool_bytes` bounds the pool (default: half the
    free GPU memory, or a quarter of the available RAM), so fewer slots may fit. Up to
    `max_waiting` more requests queue beyond the free slots; past that `start()` raises
    QueueFullError. `shadow` samples blended requests for shadow checks (engine/shadow.py).
    `selection` picks the tokens cacheblend recomputes: HKVD (CacheBlend's), or `random` of the
    same budget, a research baseline. `default_penalties` apply to requests that leave a
    penalty unset.
    """

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
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        kv_pool_bytes: int | None = None,
        max_prefill_tokens: int = 8192,
        kv_read_delay_s: float = 0.0,
        shadow: ShadowConfig | None = None,
        selection: Selection = Selection.HKVD,
        default_penalties: Penalties = NO_PENALTIES,
    ):
        self.loaded = loaded
        self.default_penalties = default_penalties
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.store = store
        self.layers = LayerRunner(self.model)
        num_layers = self.layers.shape.num_layers
        check_layers = tuple(sorted(set(check_layers))) or (min(1, num_layers - 1),)
        if not all(0 <= layer < num_layers for layer in check_layers):
            raise ValueError(f"check layers {check_layers} outside the model's 0..{num_layers - 1}")
        self.prompts = PromptBuilder(
            self.tokenizer, **({"default_system": system_prompt} if system_prompt else {})
        )
        self.prefiller = Prefiller(
            self.layers,
            store,
            loaded.fingerprint,
            self.prompts.chunk_prefix,
            check_layers,
            Controller(min_recompute_ratio, min_leading_layers=check_layers[0]),
            recompute_ratio,
            PrefixCache(prefix_cache_entries, store, loaded.fingerprint),
            kv_read_delay_s,
            selection,
        )
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.max_model_len = self._max_model_len(max_model_len)
        # A chunk must leave room for the prompt's frame and one generated token.
        frame = self.prompts.build("?", []).num_tokens
        self.max_chunk_tokens = max(0, self.max_model_len - frame - 1)
        self.estimate = QueueEstimate()
        num_slots = self._num_slots(max_num_seqs, kv_pool_bytes)
        self.runner = ModelRunner(self.layers, num_slots, self.max_model_len)
        self.scheduler = Scheduler(
            SlotTable(num_slots, self.max_model_len), max_waiting, max_prefill_tokens
        )
        self._lock = threading.Lock()  # guards the scheduler between callers and the worker
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self.shadow = Shadow(self.layers, shadow or ShadowConfig())
        self.worker = Worker(
            self._step,
            lambda: self.scheduler.has_work,
            idle=self.shadow.run_piece,
            idle_every_steps=self.shadow.config.every_steps,
        )

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

    def _max_model_len(self, requested: int | None) -> int:
        limit = self.layers.max_positions or DEFAULT_MAX_MODEL_LEN
        if requested is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if not 1 <= requested <= limit:
            raise ValueError(f"max_model_len must be in 1..{limit} (the model's), got {requested}")
        return requested

    def _num_slots(self, max_num_seqs: int, kv_pool_bytes: int | None) -> int:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        slot_bytes = ModelRunner.pool_bytes(self.layers, 1, self.max_model_len)
        budget = kv_pool_bytes if kv_pool_bytes is not None else self._default_pool_bytes()
        num_slots = min(max_num_seqs, budget // slot_bytes)
        if num_slots < 1:
            raise ValueError(
                f"the KV pool of {budget / 2**30:.2f} GiB holds no sequence of max_model_len "
                f"{self.max_model_len} ({slot_bytes / 2**30:.2f} GiB): raise the pool or lower "
                f"max_model_len"
            )
        return num_slots

    def _default_pool_bytes(self) -> int:
        device = self.layers.device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return free // 2
        return available_ram_bytes() // 4

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def controller(self) -> Controller:
        return self.prefiller.controller

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def model_name(self) -> str:
        """The model as configured, a checkpoint directory reduced to its name (no path)."""
        path = self.loaded.path
        return os.path.basename(os.path.normpath(path)) if os.path.isdir(path) else path

    def queue_estimate_s(self) -> float:
        """Expected wait before a request arriving now starts its prefill (QueueEstimate);
        takes the engine lock, which the worker holds only between steps, never while the
        model runs."""
        with self._lock:
            waiting = list(self.scheduler.waiting)
            remaining = [seq.max_tokens - seq.num_output_tokens for seq in self.scheduler.running]
            free_slots = self.scheduler.slots.num_free
        return self.estimate.wait_s(
            waiting_tokens=sum(seq.num_prompt_tokens for seq in waiting),
            waiting_seqs=len(waiting),
            running_remaining=remaining,
            free_slots=free_slots,
        )

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Call `listener` on the worker thread after every engine step."""
        self._step_listeners.append(listener)

    def chunk_key(self, tokens: tuple[int, ...]) -> str:
        return self.prefiller.chunk_key(tokens)

    # -- chunk KV ------------------------------------------------------------------------------

    def precompute(self, chunks: Iterable[Chunk | str]) -> PrecomputeResult:
        """Compute and store the standalone KV of every chunk not already in the store; waits
        until each entry is written to the store's last tier. Raises ChunkTooLongError, before
        any compute, for a chunk longer than `max_chunk_tokens`."""
        tokens = self.chunk_tokens(chunks)
        writes = [self.worker.submit(functools.partial(self._precompute, t)) for t in tokens]
        done = [w.result() for w in writes]
        return _tally(done, [d.written.result() for d in done if d.written is not None])

    async def aprecompute(self, chunks: Iterable[Chunk | str]) -> PrecomputeResult:
        """Precompute chunk by chunk as background work, between engine steps; tokenizing (and
        the length check) runs on a thread of its own, off the event loop and the model."""
        tokens = await asyncio.to_thread(self.chunk_tokens, chunks)
        done = await asyncio.gather(
            *(self.worker.run(functools.partial(self._precompute, t)) for t in tokens)
        )
        written = await asyncio.gather(
            *(asyncio.wrap_future(d.written) for d in done if d.written is not None)
        )
        return _tally(done, written)

    def chunk_tokens(self, chunks: Iterable[Chunk | str]) -> list[tuple[int, ...]]:
        """The tokens of each chunk; ChunkTooLongError names the first one longer than
        `max_chunk_tokens` (its KV could never be used)."""
        result = []
        for index, chunk in enumerate(chunks):
            name, text = (chunk.id, chunk.text) if isinstance(chunk, Chunk) else (index, chunk)
            tokens = self.prompts.chunk_tokens(text)
            if len(tokens) > self.max_chunk_tokens:
                raise ChunkTooLongError(
                    f"chunk {name!r} has {len(tokens)} tokens: more than the "
                    f"{self.max_chunk_tokens} a chunk may use in a prompt of max_model_len "
                    f"{self.max_model_len} positions"
                )
            result.append(tokens)
        return result

    def _precompute(self, tokens: tuple[int, ...]) -> ChunkWrite:
        key = self.chunk_key(tokens)
        if self.store.lookup([key])[0] is not None:
            return ChunkWrite(skipped=True)
        kv = self.compute_chunk_kv(tokens)
        return ChunkWrite(skipped=False, nbytes=kv.nbytes, written=self.store.put(key, kv))

    def compute_chunk_kv(self, tokens: tuple[int, ...]):
        return self.prefiller.compute_chunk_kv(tokens)

    def _write_back(self, tokens: tuple[int, ...]) -> None:
        key = self.chunk_key(tokens)
        if self.store.lookup([key])[0] is None:
            self.store.put(key, self.compute_chunk_kv(tokens))

    # -- prefill (also called directly by tests and benchmarks, outside the serving loop) ------

    def layout(self, request: GenerateRequest) -> PromptLayout:
        """The request's prompt (with `fit_context`, chunks dropped from the end until it fits;
        then, with chunk_order best_last, the kept chunks reversed); PromptTooLongError when it
        and max_tokens exceed a slot. Tokenizes: seconds for a long prompt, so the service calls
        it on a thread."""
        layout = self.prompts.build(
            request.question, [c.text for c in request.chunks], request.system
        )
        if request.fit_context:
            layout = layout.fitted(self.max_model_len - request.max_tokens)
        if request.chunk_order is ChunkOrder.BEST_LAST:
            layout = layout.reversed()
        self._check_length(layout, request.max_tokens)
        return layout

    def _check_length(self, layout: PromptLayout, max_tokens: int) -> None:
        if layout.num_tokens + max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {layout.num_tokens} tokens and max_tokens is {max_tokens}: "
                f"more than the engine's maximum of {self.max_model_len} positions"
            )

    def prefill(self, request: GenerateRequest) -> Prefill:
        """Lay out the request's prompt and build its KV cache in the request's mode."""
        return self.prefill_layout(self.layout(request), request.mode, request.recompute_ratio)

    def prefill_layout(
        self, layout: PromptLayout, mode: Mode, recompute_ratio: float | None = None
    ) -> Prefill:
        """Build the KV cache of a laid-out prompt into fresh tensors (not the pool)."""
        return self.prefiller.prefill(layout, mode, recompute_ratio)

    # -- serving -------------------------------------------------------------------------------

    def start(self, request: GenerateRequest, layout: PromptLayout | None = None) -> Generation:
        """Queue a generation; iterate the returned object on the calling event loop.

        `layout` replaces the prompt built from the request's text (benchmarks). Raises
        QueueFullError when the queue and the KV pool are full, PromptTooLongError when the
        prompt and max_tokens exceed a slot.
        """
        generation = Generation()
        seq = self._submit(request, layout, generation.deliver)
        generation.bind(functools.partial(self._cancel, seq))
        return generation

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta | GenerateResult]:
        """Token deltas then the result; leaving the loop early cancels the generation."""
        async for event in self.start(request):
            yield event

    def generate(
        self, request: GenerateRequest, layout: PromptLayout | None = None
    ) -> GenerateResult:
        """Answer one request, blocking the calling thread (never the worker's)."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._submit(request, layout, events.put)
        while True:
            event = events.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, GenerateResult):
                return event

    def _submit(
        self, request: GenerateRequest, layout: PromptLayout | None, emit: Callable[[Event], None]
    ) -> Sequence:
        if layout is None:
            layout = self.layout(request)
        else:
            self._check_length(layout, request.max_tokens)
        seq = Sequence(
            request=request,
            layout=layout,
            sampler=Sampler(request.temperature, request.top_p, request.seed),
            penalties=request.penalties(self.default_penalties),
            text=IncrementalText(self.tokenizer, request.stop),
            emit=emit,
            arrival_s=time.perf_counter(),
        )
        with self._lock:
            self.scheduler.add(seq)
        self.worker.wake()
        return seq

    def _cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self.worker.wake()

    # -- one step, on the worker thread ------------------------------------------------------

    def _step(self) -> None:
        self.shadow.preempt()  # client work first: shadows run on idle time only
        with self._lock:
            for seq in [*self.scheduler.waiting, *self.scheduler.running]:
                if seq.cancelled:
                    self.scheduler.finish(seq)
                    seq.emit(GenerationCancelled())
            seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return
        start = time.perf_counter()
        if is_prefill:
            self._prefill_step(seqs)
            num_tokens = sum(seq.num_prompt_tokens for seq in seqs)
        else:
            self._decode(seqs)
            num_tokens = len(seqs)
        record = StepRecord(is_prefill, len(seqs), num_tokens, time.perf_counter() - start)
        self.estimate.observe(is_prefill, num_tokens, record.seconds)
        with self._lock:
            finished = [seq for seq in seqs if seq.finish_reason is not None]
            for seq in finished:
                self.scheduler.finish(seq)
            busy = self.scheduler.has_work
        for seq in finished:
            if seq.shadow is not None and seq.finish_reason != "error":
                self.shadow.submit(seq.shadow, busy)
        for listener in self._step_listeners:
            listener(record)

    def _prefill_step(self, seqs: list[Sequence]) -> None:
        """Prefill the step's sequences one after the other. Their KV streams are all opened
        first, in order, so the store's one loader reads the next prompt's first layers while
        the current one computes."""
        ahead: list[KVLayerStream | None] = []
        try:
            for seq in seqs:
                request = seq.request
                ahead.append(
                    self.prefiller.open_ahead(seq.layout, request.mode, request.recompute_ratio)
                    if len(seqs) > 1
                    else None
                )
            for seq, stream in zip(seqs, ahead, strict=True):
                self._prefill(seq, stream)
        finally:
            for stream in ahead:  # the prefill closed those it took; closing is idempotent
                if stream is not None:
                    stream.close()

    def _prefill(self, seq: Sequence, opened: KVLayerStream | None = None) -> None:
        seq.scheduled_s = time.perf_counter()
        request, num_tokens = seq.request, seq.num_prompt_tokens
        assert seq.slot is not None
        try:
            prefill = self.prefiller.prefill(
                seq.layout,
                request.mode,
                request.recompute_ratio,
                self.runner.slot_kv(seq.slot, num_tokens),
                opened,
            )
        except Exception as exc:
            log.exception("prefill failed")
            self._fail(seq, exc)
            return
        prefill.prefill_s = time.perf_counter() - seq.scheduled_s
        seq.prefill, seq.num_cached = prefill, num_tokens
        for tokens in prefill.missing_chunks:
            self.worker.submit(functools.partial(self._write_back, tokens))
        # Penalised tokens are no greedy continuation that the shadow's full prefill could match.
        seq.shadow = self.shadow.sample(
            request.mode,
            seq.layout.token_ids,
            request.temperature == 0.0 and seq.penalties.neutral,
            prefill.blend.fell_back_to_full_prefill,
            (prefill.output.keys, prefill.output.values),
        )
        logits = prefill.output.logits
        if not seq.penalties.neutral:
            self.runner.penalties.start(seq.slot, seq.layout.token_ids)
        self._accept(seq, self._penalised([seq], logits[None])[0], logits)

    def _decode(self, seqs: list[Sequence]) -> None:
        try:
            logits = self.runner.decode(
                [s.slot for s in seqs],  # type: ignore[misc]
                [s.num_cached for s in seqs],
                [s.next_token for s in seqs],  # type: ignore[misc]
            )
        except Exception as exc:
            log.exception("decode step failed")
            for seq in seqs:
                self._fail(seq, exc)
            return
        penalised = self._penalised(seqs, logits)
        for seq, row, raw in zip(seqs, penalised, logits, strict=True):
            seq.num_cached += 1
            self._accept(seq, row, raw)

    def _penalised(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] with each sequence's penalties applied, in one batched operation."""
        slots = [s.slot for s in seqs]
        return self.runner.penalties.apply(logits, slots, [s.penalties for s in seqs])  # type: ignore[arg-type]

    def _accept(self, seq: Sequence, logits: torch.Tensor, raw_logits: torch.Tensor) -> None:
        """Sample the next token from the (penalised) logits, hand its text to the consumer, and
        decide whether to stop. The shadow check compares the model's own, raw logits."""
        token = seq.sampler(logits)
        if seq.shadow is not None:
            seq.shadow.observe(raw_logits, token)
        now = time.perf_counter()
        if seq.first_token_s is None:
            seq.first_token_s = now
        if token in self.eos_ids and not seq.request.ignore_eos:
            self._finish(seq, "stop")
            return
        piece = seq.text.add(token)
        seq.emit(TokenDelta(piece, token))
        if seq.text.stopped:
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            self._finish(seq, "length")
        else:
            seq.next_token = token
            if not seq.penalties.neutral:
                self.runner.penalties.add(seq.slot, token)  # type: ignore[arg-type]

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        seq.finish_reason = "error"
        seq.emit(exc)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        tail = seq.text.flush()
        if tail:
            seq.emit(TokenDelta(tail, None))
        seq.emit(self._result(seq))

    def _result(self, seq: Sequence) -> GenerateResult:
        prefill, end = seq.prefill, time.perf_counter()
        assert prefill is not None and seq.first_token_s is not None
        assert seq.scheduled_s is not None and seq.finish_reason is not None
        usage = prefill.usage
        usage.completion_tokens = seq.num_output_tokens
        computes = prefill.output.layer_computes
        return GenerateResult(
            text=seq.text.text,
            finish_reason=seq.finish_reason,
            usage=usage,
            timings=Timings(
                ttft_s=seq.first_token_s - seq.arrival_s,
                queue_s=seq.scheduled_s - seq.arrival_s,
                prefill_s=prefill.prefill_s,
                kv_load_s=prefill.kv_load_s,
                kv_wait_s=prefill.output.kv_wait_s,
                recompute_s=sum(c.compute_end_s - c.compute_start_s for c in computes),
                decode_s=end - seq.first_token_s,
                total_s=end - seq.arrival_s,
                overlap=prefill.overlap,
            ),
            blend=prefill.blend,
            token_ids=list(seq.text.token_ids),
            layers=prefill.timeline,
            chunk_tiers=in_request_order(prefill.chunk_tiers, seq.request.chunk_order),
            load_bytes_by_tier=prefill.load_bytes_by_tier,
            dropped_chunks=seq.layout.dropped_chunks,
        )

    def drain(self) -> None:
        """Wait for queued background work (precompute, KV write-back) to finish."""
        self.worker.drain()

    def close(self) -> None:
        """Cancel every sequence and stop the worker thread."""
        with self._lock:
            for seq in [*self.scheduler.waiting, *self.scheduler.running]:
                seq.cancelled = True
        self.worker.close()


def _tally(done: list[ChunkWrite], written: list[bool]) -> PrecomputeResult:
    """`written`: the write outcome of each chunk of `done` that was not skipped, in order."""
    computed = [d for d in done if not d.skipped]
    return PrecomputeResult(
        stored=sum(written),
        skipped=len(done) - len(computed),
        failed=len(written) - sum(written),
        bytes=sum(d.nbytes for d in computed),
    )


def in_request_order(per_chunk: list, order: ChunkOrder) -> list:
    """Per-chunk values of a prompt, in the order of the request's chunks."""
    return per_chunk[::-1] if order is ChunkOrder.BEST_LAST else per_chunk
