"""Prometheus metrics of the engine service (`ragblend_engine_*`), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.quality.shadow import SAMPLED_MODES, ShadowReport
from engine.types import GenerateResult, Mode, StepRecord
from kvstore import tiers
from kvstore.remote_tier import RemoteTier
from kvstore.types import TierStats

# vLLM's time-to-first-token buckets.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
# vLLM's time-per-output-token buckets.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
# One Redis operation: a loopback round trip (~0.1 ms) up to the tier's timeout (0.5 s default).
REMOTE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
# Shares in [0, 1]; top-k agreement with the default k = 5 moves in steps of 0.2.
AGREEMENT_BUCKETS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.8, 0.9, 0.95, 0.99, 1.0)
# KL divergence in nats: ~1e-7 is float rounding of an exact blend, ~1 a different answer.
KL_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


class EngineMetrics:
    def __init__(self, engine):
        self.engine = engine
        self.registry = r = CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"ragblend_engine_{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(f"ragblend_engine_{name}", doc, labels, buckets=buckets, registry=r)

        self.requests = counter(
            "requests", "Generations finished, by mode and finish reason", "mode", "finish_reason"
        )
        self.ttft = histogram("ttft_seconds", "Time to first token, by mode", TTFT_BUCKETS, "mode")
        self.kv_load_seconds = histogram(
            "kv_load_seconds",
            "Time spent loading chunk KV per request, by tier",
            TTFT_BUCKETS,
            "tier",
        )
        self.kv_load_bytes = counter("kv_load_bytes", "Chunk KV bytes loaded, by tier", "tier")
        self.kv_lookups = counter(
            "kv_lookups",
            "Chunk KV lookups, by tier and result (tiers are asked fastest first until a hit)",
            "tier",
            "result",
        )
        self.kv_chunks = counter(
            "kv_chunks", "Chunks whose KV was looked up (the denominator of the hit rate)"
        )
        self.recomputed_tokens = counter(
            "recomputed_tokens", "Chunk tokens whose KV was computed for a request"
        )
        self.reused_tokens = counter(
            "reused_tokens", "Prompt tokens whose KV came from a cache unchanged"
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.recompute_ratio = histogram(
            "recompute_ratio", "Recompute ratio used by cacheblend requests", RATIO_BUCKETS
        )
        self.overlap = histogram(
            "pipeline_overlap_ratio",
            "Fraction of KV load time hidden behind compute",
            (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
        )
        self.precomputed_chunks = counter(
            "precomputed_chunks", "Chunks precomputed, by result", "result"
        )
        self.errors = counter("errors", "Failed requests, by kind", "kind")
        for kind in ("queue_full", "generation"):  # zero series, so dashboards show 0 errors
            self.errors.labels(kind)
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time from arrival until the prefill started",
            TTFT_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Mean time between output tokens of a request, after the first",
            TPOT_BUCKETS,
        )
        self.batch_size = histogram(
            "batch_size",
            "Sequences per engine step, by kind of work: decode (the decode batch) or prefill "
            "(the prefills that computed, whole or a piece)",
            BATCH_BUCKETS,
            "step",
        )
        self.step_tokens = histogram(
            "step_tokens",
            "Tokens per engine step, by kind of work: decode (tokens fed) or prefill (prompt "
            "tokens of the prefills that completed)",
            STEP_TOKEN_BUCKETS,
            "step",
        )
        self.step_seconds = histogram(
            "step_seconds",
            "Seconds of one engine step's decode or prefill work, by kind",
            TTFT_BUCKETS,
            "step",
        )
        self.remote_seconds = histogram(
            "remote_seconds",
            "Latency of one Redis operation of the remote KV tier, by operation (lookup: the "
            "headers or presence of a prompt's chunks in one pipelined round trip; get: a layer; "
            "put, delete, ping); a skipped one (Redis unreachable, backing off) is not observed",
            REMOTE_BUCKETS,
            "op",
        )
        self.shadow_topk = histogram(
            "shadow_topk_agreement",
            "Shadow checks: share of the top-k first tokens of full prefill the blend also has",
            AGREEMENT_BUCKETS,
            "mode",
        )
        self.shadow_kl = histogram(
            "shadow_kl_divergence",
            "Shadow checks: KL(full prefill || blend) of the first-token distributions, in nats",
            KL_BUCKETS,
            "mode",
        )
        self.shadow_greedy = histogram(
            "shadow_greedy_agreement",
            "Shadow checks of greedy requests: agreeing prefix of the greedy continuations, as a "
            "share of the tokens compared",
            AGREEMENT_BUCKETS,
            "mode",
        )
        self.shadow_answer_kl = histogram(
            "shadow_answer_kl",
            "Shadow checks, teacher-forced: mean KL(full prefill || blend) in nats of the "
            "next-token distributions over full prefill's greedy answer fed after each prompt KV",
            KL_BUCKETS,
            "mode",
        )
        self.shadow_answer_argmax = histogram(
            "shadow_answer_argmax_agreement",
            "Shadow checks, teacher-forced: share of full prefill's answer positions whose most "
            "likely next token the blend's prompt KV also puts first",
            AGREEMENT_BUCKETS,
            "mode",
        )
        shadow_histograms = (
            self.shadow_topk,
            self.shadow_kl,
            self.shadow_greedy,
            self.shadow_answer_kl,
            self.shadow_answer_argmax,
        )
        for mode in SAMPLED_MODES:  # zero series from the start
            for series in shadow_histograms:
                series.labels(mode.value)
        engine.shadow.add_listener(self.observe_shadow)
        remote = engine.store.tier(tiers.REMOTE)
        if isinstance(remote, RemoteTier):
            remote.add_latency_listener(self.observe_remote)
        r.register(_LiveState(engine))
        engine.add_step_listener(self.observe_step)

    def observe_remote(self, op: str, seconds: float) -> None:
        self.remote_seconds.labels(op).observe(seconds)

    def observe_shadow(self, report: ShadowReport) -> None:
        mode = report.mode.value
        self.shadow_topk.labels(mode).observe(report.topk_agreement)
        self.shadow_kl.labels(mode).observe(report.kl_divergence)
        if report.greedy_agreement is not None:
            self.shadow_greedy.labels(mode).observe(report.greedy_agreement)
        self.shadow_answer_kl.labels(mode).observe(report.answer_kl)
        self.shadow_answer_argmax.labels(mode).observe(report.answer_argmax_agreement)

    def observe_step(self, step: StepRecord) -> None:
        if step.num_decodes:
            self.batch_size.labels("decode").observe(step.num_decodes)
            self.step_tokens.labels("decode").observe(step.num_decodes)
            if not step.decode_fused:  # else its time is the prefill's, in one forward
                self.step_seconds.labels("decode").observe(step.decode_s)
        if step.num_prefills:
            self.batch_size.labels("prefill").observe(step.num_prefills)
            self.step_tokens.labels("prefill").observe(step.prefill_tokens)
            self.step_seconds.labels("prefill").observe(step.prefill_s)

    def observe(self, mode: Mode, result: GenerateResult) -> None:
        self.requests.labels(mode.value, result.finish_reason).inc()
        self.ttft.labels(mode.value).observe(result.timings.ttft_s)
        self.queue_time.observe(result.timings.queue_s)
        if result.usage.completion_tokens > 1:
            self.time_per_output_token.observe(
                result.timings.decode_s / (result.usage.completion_tokens - 1)
            )
        usage = result.usage
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.recomputed_tokens.inc(usage.recomputed_tokens)
        self.reused_tokens.inc(usage.cached_tokens)
        if mode is Mode.CACHEBLEND:
            self.recompute_ratio.observe(result.blend.recompute_ratio)
        for tier, num_bytes in result.load_bytes_by_tier.items():
            self.kv_load_bytes.labels(tier).inc(num_bytes)
        if result.load_bytes_by_tier:
            self.overlap.observe(result.timings.overlap)
            by_tier = result.load_bytes_by_tier
            busiest_tier = max(by_tier, key=lambda tier: by_tier[tier])
            self.kv_load_seconds.labels(busiest_tier).observe(result.timings.kv_load_s)
        names = [tier.name for tier in self.engine.store.tiers]
        for chunk_tier in result.chunk_tiers:
            self.kv_chunks.inc()
            for name in names:
                hit = chunk_tier == name
                self.kv_lookups.labels(name, "hit" if hit else "miss").inc()
                if hit:
                    break


class _LiveState:
    """Gauges read at scrape time: queue, running work and store occupancy."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine = self.engine
        running = GaugeMetricFamily("ragblend_engine_requests_running", "Generations running")
        running.add_metric([], engine.num_running)
        waiting = GaugeMetricFamily("ragblend_engine_requests_waiting", "Generations waiting")
        waiting.add_metric([], engine.num_waiting)
        background = GaugeMetricFamily(
            "ragblend_engine_background_tasks_waiting", "Precompute and write-back tasks waiting"
        )
        background.add_metric([], engine.worker.waiting_background)
        queue = engine.worker.background
        pieces = CounterMetricFamily(
            "ragblend_engine_background_pieces",
            "Pieces of background work run (under load one after each step, within what the "
            "step left)",
        )
        pieces.add_metric([], queue.pieces)
        dropped = CounterMetricFamily(
            "ragblend_engine_background_dropped",
            "KV write-backs dropped because the background queue was full",
        )
        dropped.add_metric([], queue.dropped)
        blocks, use = engine.scheduler.blocks, engine.kv_pool_use()
        # Idle shared prefixes are not counted: admission gives their blocks back on demand, so
        # a pool they fill still admits.
        pool_usage = GaugeMetricFamily(
            "ragblend_engine_kv_pool_usage_ratio",
            "Fraction of the KV pool's blocks running sequences hold (idle shared prefixes not "
            "counted)",
        )
        pool_usage.add_metric([], use.in_use / blocks.num_blocks)
        pool_blocks = GaugeMetricFamily(
            "ragblend_engine_kv_pool_blocks",
            f"KV pool blocks (of {blocks.block_size} positions each)",
        )
        pool_blocks.add_metric([], blocks.num_blocks)
        shared_blocks = GaugeMetricFamily(
            "ragblend_engine_kv_shared_prefix_blocks",
            "KV pool blocks holding prompt prefixes shared by the sequences that start with them, "
            "by state: shared by running sequences, or idle (given back on demand)",
            labels=["state"],
        )
        shared_blocks.add_metric(["shared"], use.prefix_shared)
        shared_blocks.add_metric(["idle"], use.prefix_idle)
        stats = engine.store.stats()
        entries = GaugeMetricFamily(
            "ragblend_engine_store_entries", "KV entries by tier", labels=["tier"]
        )
        size = GaugeMetricFamily("ragblend_engine_store_bytes", "KV bytes by tier", labels=["tier"])
        corrupt = GaugeMetricFamily(
            "ragblend_engine_store_corrupt_entries",
            "Bad KV entries found (deleted, recomputed), by tier",
            labels=["tier"],
        )
        for name, tier in stats.tiers.items():
            if tier.entries is not None:  # the remote tier's are Redis's, unknown here
                entries.add_metric([name], tier.entries)
            if tier.bytes is not None:
                size.add_metric([name], tier.bytes)
            corrupt.add_metric([name], tier.corrupt)
        # Only the write-through to persistent tiers can fail (an in-memory put over budget
        # is a skip, not a failure).
        write_failures = CounterMetricFamily(
            "ragblend_engine_kv_write_failures",
            "KV entries whose write to a tier failed (e.g. disk full, Redis down), by tier",
            labels=["tier"],
        )
        for name, count in stats.write_errors_by_tier.items():
            write_failures.add_metric([name], count)
        yield from self._remote(stats.tiers.get(tiers.REMOTE))
        yield from self._shadow(engine)
        queue_estimate = GaugeMetricFamily(
            "ragblend_engine_queue_estimate_seconds",
            "Expected wait before a request arriving now starts its prefill",
        )
        queue_estimate.add_metric([], engine.queue_estimate_s())
        yield from (running, waiting, background, pieces, dropped)
        yield from (pool_usage, pool_blocks, shared_blocks)
        yield from (entries, size, corrupt)
        yield from (write_failures, queue_estimate)

    @staticmethod
    def _shadow(engine):
        """The shadow checks' counts, kept by the engine (engine/quality/shadow.py)."""
        stats = engine.shadow.stats
        eligible = CounterMetricFamily(
            "ragblend_engine_shadow_eligible",
            "Requests a shadow check could have been sampled from (cacheblend and full_reuse "
            "requests that reused KV), by mode",
            labels=["mode"],
        )
        coverage = GaugeMetricFamily(
            "ragblend_engine_shadow_coverage",
            "Share of the eligible requests checked since start, by mode (at most shadow_fraction)",
            labels=["mode"],
        )
        checks = CounterMetricFamily(
            "ragblend_engine_shadow_checks",
            "Shadow checks done (a sampled request compared with full prefill), by mode",
            labels=["mode"],
        )
        agreements = CounterMetricFamily(
            "ragblend_engine_shadow_first_token_agreements",
            "Shadow checks whose first token (argmax) was full prefill's, by mode",
            labels=["mode"],
        )
        for mode in SAMPLED_MODES:
            eligible.add_metric([mode.value], stats.eligible[mode])
            coverage.add_metric([mode.value], stats.checks[mode] / max(stats.eligible[mode], 1))
            checks.add_metric([mode.value], stats.checks[mode])
            agreements.add_metric([mode.value], stats.first_token_agreements[mode])
        skipped = CounterMetricFamily(
            "ragblend_engine_shadow_skipped",
            "Sampled requests not checked, by reason (busy, queue_full, budget, memory, "
            "preempted, error)",
            labels=["reason"],
        )
        for reason, count in stats.skipped.items():
            skipped.add_metric([reason], count)
        seconds = CounterMetricFamily(
            "ragblend_engine_shadow_seconds",
            "Compute time spent on shadow checks (idle time and their share of busy steps)",
        )
        seconds.add_metric([], stats.seconds)
        pending = GaugeMetricFamily(
            "ragblend_engine_shadow_pending", "Shadow checks queued or in progress"
        )
        pending.add_metric([], engine.shadow.pending)
        kv_bytes = GaugeMetricFamily(
            "ragblend_engine_shadow_kv_bytes",
            "KV bytes the pending shadow checks hold or will hold (at most shadow_kv_gb)",
        )
        kv_bytes.add_metric([], engine.shadow.kv_bytes)
        yield from (eligible, coverage, checks, agreements, skipped, seconds, pending, kv_bytes)

    @staticmethod
    def _remote(remote: TierStats | None):
        """The remote tier's state, when there is one."""
        if remote is None:
            return
        up = GaugeMetricFamily(
            "ragblend_engine_remote_up",
            "Whether the remote KV tier's Redis answered the last operation (0: backing off)",
        )
        up.add_metric([], 1 if remote.reachable else 0)
        written = CounterMetricFamily(
            "ragblend_engine_remote_written_bytes",
            "Chunk KV bytes this engine wrote to the remote tier",
        )
        written.add_metric([], remote.bytes_written)
        yield from (up, written)
