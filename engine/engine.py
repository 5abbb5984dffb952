"""The engine's Python API, the front only: load a model, precompute chunk KV (chunks.py), serve
many requests at once (scheduler.py picks each step, executor.py runs it on the worker thread)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from engine.blend.check import default_selection
from engine.blend.controller import Controller
from engine.blend.dense import run_to_end
from engine.blend.layout import PromptBuilder, PromptLayout, fitting, request_layout
from engine.blend.prefill import Prefill, PrefillAsk, Prefiller
from engine.blend.prefix_cache import PrefixCache
from engine.chunks import ChunkPrecompute
from engine.errors import GenerationCancelled
from engine.grammar.batch import GrammarMasks
from engine.grammar.compile import CompiledGrammar, GrammarCompiler
from engine.model.cpu_linear import prepack_linears
from engine.model.eos import eos_token_ids
from engine.model.layers import LayerOps
from engine.model.load import LoadedModel, load_model
from engine.options import EngineOptions, prefill_batch_default
from engine.quality.shadow import Shadow
from engine.runner.model_runner import ModelRunner
from engine.sched.background import BackgroundQueue
from engine.sched.blocks import BlockManager
from engine.sched.calibrate import MeasuredBudget, measure_step_budget
from engine.sched.estimate import QueueEstimate, lane_holders_remaining
from engine.sched.executor import Executor
from engine.sched.job import Event, Job, new_job
from engine.sched.postprocess import Postprocessor
from engine.sched.scheduler import PoolUse, Scheduler
from engine.sched.worker import Worker
from engine.streaming import Generation
from engine.types import Chunk, GenerateRequest, GenerateResult, PrecomputeResult, StepRecord
from kvstore.loader import KVLayerStream
from kvstore.store import KVStore, KVStoreConfig


class Engine:
    """CacheBlend over one model and one KV store; `options`: the fields of EngineOptions."""

    def __init__(self, loaded: LoadedModel, store: KVStore, **options: Any):
        self.options = opts = EngineOptions(**options)
        self.loaded, self.store = loaded, store
        # A request's sampling field left out: the engine's setting, else the model's own.
        self.defaults = opts.generation_defaults.over(loaded.generation_defaults)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        if opts.cpu_prepacked_linear:
            prepack_linears(self.model)
        self.ops = LayerOps(self.model)
        system = {"default_system": opts.system_prompt} if opts.system_prompt else {}
        self.prompts = PromptBuilder(self.tokenizer, **system)
        self.prefiller = _prefiller(self.ops, store, loaded.fingerprint, self.prompts, opts)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.estimate = QueueEstimate()
        self.runner = ModelRunner.sized(
            self.ops, opts.max_num_seqs, opts.max_model_len, opts.kv_pool_bytes
        )
        self.runner.use_attention(opts.decode_attention)
        if opts.cuda_graph_max_batch:
            self.runner.use_cuda_graphs(opts.cuda_graph_max_batch)
        self.max_model_len = self.runner.max_model_len
        blocks = BlockManager(self.runner.num_blocks, self.runner.block_size)
        budget = (
            MeasuredBudget(opts.max_num_batched_tokens)
            if opts.max_num_batched_tokens
            else measure_step_budget(self.ops, self.runner, opts.max_num_seqs)
        )
        self.scheduler: Scheduler[Job] = Scheduler(
            blocks,
            opts.max_num_seqs,
            opts.max_waiting,
            opts.max_prefill_tokens,
            budget.tokens,
            shared_prefixes=opts.prefix_cache_entries,
            decode_weight=budget.decode_weight,
        )
        self._lock = threading.Lock()  # guards the scheduler between callers and the worker
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self.shadow = Shadow(self.ops, opts.shadow)
        self.worker = Worker(
            self._step,
            lambda: self.scheduler.has_work,
            idle=self.shadow.run_piece,
            idle_every_steps=self.shadow.config.every_steps,
            background=BackgroundQueue(opts.max_background_chunks, self.ops.shape.num_layers),
        )
        self.chunks = ChunkPrecompute(
            self.prompts, self.prefiller, store, self.worker, self.max_model_len
        )
        vocab_size = self.model.lm_head.weight.shape[0]  # the width of the logits
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size, self.eos_ids)
        masks = GrammarMasks(opts.max_num_seqs, vocab_size)
        post = Postprocessor(self.eos_ids, self.runner.penalties, masks)
        device = loaded.device.type
        batch = opts.prefill_batch_tokens
        if batch is None:
            batch = prefill_batch_default(device)
        self.executor = Executor(
            self.prefiller,
            self.runner,
            self.shadow,
            self.chunks.write_back,
            post,
            self.estimate,
            batch,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        device: str = "cpu",
        dtype: str = "float32",
        store: KVStore | None = None,
        **options: Any,
    ) -> Engine:
        """Load `path` (checkpoint directory or cached hub id); the default store is memory-only."""
        loaded = load_model(path, device=device, dtype=dtype)
        if store is None:
            pin = loaded.device.type == "cuda"
            store = KVStore(KVStoreConfig(model_fingerprint=loaded.fingerprint, pin_memory=pin))
        return cls(loaded, store, **options)

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def model_name(self) -> str:
        return self.loaded.name

    def queue_estimate_s(self) -> float:
        """Expected wait before a request arriving now starts its prefill (QueueEstimate); takes
        the engine lock, which the worker holds only between steps, never while the model runs."""
        with self._lock:
            return self.estimate.wait_for(self.scheduler)

    def room_after_s(self) -> float:
        """When a full queue may take another request (QueueEstimate.room_after_s)."""
        with self._lock:
            return self.estimate.room_after_s(lane_holders_remaining(self.scheduler))

    def kv_pool_use(self) -> PoolUse:
        """The KV pool's blocks by holder (Scheduler.pool_use), counted under the engine lock:
        the shared prefixes' entries change on the worker thread."""
        with self._lock:
            return self.scheduler.pool_use()

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Call `listener` on the worker thread after every engine step."""
        self._step_listeners.append(listener)

    def chunk_key(self, tokens: tuple[int, ...], cache_salt: str = "") -> str:
        return self.prefiller.chunk_key(tokens, cache_salt)

    def precompute(self, chunks: Iterable[Chunk | str]) -> PrecomputeResult:
        """Store every chunk's standalone KV, waiting for the writes (ChunkPrecompute)."""
        return self.chunks.precompute(chunks)

    async def aprecompute(self, chunks: Iterable[Chunk | str]) -> PrecomputeResult:
        return await self.chunks.aprecompute(chunks)

    def layout(self, request: GenerateRequest) -> PromptLayout:
        """The request's prompt (prompt.request_layout), checked to fit max_model_len. Tokenizes:
        seconds for a long prompt, so the service calls it on a thread."""
        return request_layout(self.prompts, request, self.max_model_len)

    def prefill(self, request: GenerateRequest, scores: tuple[float, ...] | None = None) -> Prefill:
        """Lay out the request's prompt and build its KV cache in fresh tensors (not the pool),
        outside the serving loop (tests, benchmarks; `scores`: an oracle's, engine/oracle.py)."""
        ask = PrefillAsk.of(request, scores)
        return run_to_end(self.prefiller.prefill(self.layout(request), ask))

    def open_kv(self, request: GenerateRequest, layout: PromptLayout) -> KVLayerStream | None:
        """The request's chunk KV streams looked up now, parked until its prefill starts (None:
        its mode reads no chunk KV). The lookups read SSD headers and ask Redis (one pipelined
        round trip): call it where a wait may fall, as `start`'s caller does with `layout`."""
        return self.prefiller.open_ahead(layout, PrefillAsk.of(request), parked=True)

    def compile_grammar(self, request: GenerateRequest) -> CompiledGrammar | None:
        """The compiled grammar of the request's json_schema (None: free text), cached per
        schema; raises GrammarError naming what the library rejects. A new schema takes
        milliseconds (docs/benchmarks/structured-output.md): the service calls it on a thread,
        as it tokenizes."""
        if request.json_schema is None:
            return None
        return self.grammars.compile(request.json_schema)

    def start(
        self,
        request: GenerateRequest,
        layout: PromptLayout | None = None,
        opened: KVLayerStream | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> Generation:
        """Queue a generation; iterate the returned object on the calling event loop. `layout`
        replaces the prompt built from the request's text; `opened`, its `open_kv` (else the
        lookups run here); `grammar`, its `compile_grammar` (else compiled here). Raises
        QueueFullError when queue and KV pool are full, PromptTooLongError when the prompt
        plus max_tokens exceed max_model_len, GrammarError for a schema that does not compile."""
        generation = Generation()
        seq, generation.queue_estimate_s = self._submit(
            request, layout, generation.deliver, opened, grammar
        )
        generation.bind(lambda: self._cancel(seq))
        return generation

    def generate(
        self, request: GenerateRequest, layout: PromptLayout | None = None
    ) -> GenerateResult:
        """Answer one request, blocking the calling thread (never the worker's)."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._submit(request, layout, events.put)
        while not isinstance(event := events.get(), GenerateResult):
            if isinstance(event, BaseException):
                raise event
        return event

    def _submit(
        self,
        request: GenerateRequest,
        layout: PromptLayout | None,
        emit: Callable[[Event], None],
        opened: KVLayerStream | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> tuple[Job, float]:
        """The queued job and the wait the queue estimate announces for it, taken as it is
        queued: exact about what is ahead, where /health's is already old for a burst. Its KV
        lookups are done here, on the caller's thread, not in an engine step."""
        try:
            if layout is None:
                layout = self.layout(request)
            else:
                fitting(layout, request.max_tokens, self.max_model_len)
            if grammar is None:
                grammar = self.compile_grammar(request)
            seq = new_job(request, layout, self.tokenizer, self.defaults, emit, grammar)
            if opened is None:
                opened = self.open_kv(request, layout)
            seq.opened = opened
            with self._lock:
                wait_s = self.estimate.wait_for(self.scheduler)
                self.scheduler.add(seq)
        except BaseException:
            if opened is not None:  # never queued: its streams go now
                opened.close()
            raise
        self.worker.wake()
        return seq, wait_s

    def _cancel(self, seq: Job) -> None:
        seq.cancelled = True
        self.worker.wake()

    def _step(self) -> float:
        """One step on the worker thread: schedule, run, then free the finished sequences; the
        tokens it leaves background work (Step.background_tokens)."""
        self.shadow.preempt()  # client work first: shadows run on idle time only
        with self._lock:
            for seq in self.scheduler.drop_cancelled():
                self.executor.abandon(seq)
                seq.emit(GenerationCancelled())
            step = self.scheduler.schedule()
        seqs = step.sequences
        if not seqs:
            return step.background_tokens
        record = self.executor.run(step)
        self.estimate.observe(record)
        with self._lock:
            finished = self.scheduler.finish_done(seqs)
            busy = self.scheduler.has_work
        self.executor.submit_shadows(finished, busy)
        for listener in self._step_listeners:
            listener(record)
        return step.background_tokens

    def drain(self) -> None:
        """Wait for queued background work (precompute, KV write-back) to finish."""
        self.worker.drain()

    def close(self) -> None:
        """Cancel every sequence, stop the worker thread, and close the KV streams of the
        sequences it left (queued ones hold theirs, parked)."""
        with self._lock:
            self.scheduler.cancel_all()
        self.worker.close()
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            self.executor.abandon(seq)


def _prefiller(
    ops: LayerOps, store: KVStore, fingerprint: str, prompts: PromptBuilder, opts: EngineOptions
) -> Prefiller:
    """The prefiller of `opts`: its check layers, selection, ratio, controller, prefix cache."""
    check_layers = opts.check_layers_of(ops.shape.num_layers)
    return Prefiller(
        ops,
        store,
        fingerprint,
        prompts.chunk_prefix,
        check_layers,
        Controller(),
        opts.recompute_ratio,
        opts.min_recompute_ratio,
        PrefixCache(opts.prefix_cache_entries, store, fingerprint),
        opts.kv_read_delay_s,
        opts.selection or default_selection(check_layers),
        opts.auto_coverage,
        opts.auto_max_ratio,
    )
