"""The engine's options, one typed record: what `Engine(loaded, store, **options)` accepts, with
its defaults; the service fills it from its settings (engine/api/main.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.contract import MAX_PRECOMPUTE_CHUNKS
from engine.blend.check import default_check_layers
from engine.blend.selection import Selection
from engine.quality.shadow import ShadowConfig
from engine.types import DEFAULT_RECOMPUTE_RATIO, DecodeAttention, GenerationDefaults


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """Up to `max_num_seqs` sequences run together, each of at most `max_model_len` positions
    (default: the model's, at most 8192), their KV in blocks of 16 positions reserved for prompt
    plus max_tokens; `kv_pool_bytes` bounds the pool (default: half the free GPU memory, or a
    quarter of the available RAM; never more than max_num_seqs x max_model_len positions). Up
    to `max_waiting` more requests queue beyond those the free blocks admit; past that
    `start()` raises QueueFullError. Up to `max_background_chunks` chunk computations
    (precompute, write-back) wait; past that a precompute raises BackgroundQueueFullError and a
    write-back is dropped. A step feeds the model at most `max_num_batched_tokens`
    tokens, one per decoding sequence first; prefills fill the rest and pause where it ends
    (default: measured at start with what a decoding sequence costs in prompt tokens,
    engine/sched/calibrate.py). `shadow` samples blended requests for
    shadow checks (engine/quality/shadow.py).
    `selection` picks the tokens cacheblend recomputes (common.contract.Selection; `random` is a
    research baseline); the default, `query_hkvd` over the default check layers, is the best
    measured at equal TTFT (docs/quality.md), `hkvd` where one check layer is all there is.
    `recompute_ratio="auto"` (or a request's) lets the check layer keep the tokens that cover
    `auto_coverage` of the selection's mass, at most `auto_max_ratio`.
    `generation_defaults` apply to requests that leave a sampling field unset, before the
    model's generation_config and greedy decoding (GenerationDefaults). `prefix_cache_entries`
    bounds both the exact prompt prefixes kept in the KV store (engine/prefix_cache.py) and
    those held once in the KV pool, shared by the sequences that start with one
    (engine/shared_prefix.py; 0: neither).
    """

    check_layers: tuple[int, ...] = ()  # (): the model's default, default_check_layers()
    recompute_ratio: float | str | None = None
    min_recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    system_prompt: str | None = None
    prefix_cache_entries: int = 16
    max_waiting: int = 64
    max_background_chunks: int = MAX_PRECOMPUTE_CHUNKS  # one precompute request always fits
    max_num_seqs: int = 16
    max_model_len: int | None = None
    kv_pool_bytes: int | None = None
    max_prefill_tokens: int = 8192
    max_num_batched_tokens: int | None = None  # None: measured at start (engine/sched/calibrate.py)
    prefill_batch_tokens: int | None = None  # None: prefill_batch_default() of the device
    cuda_graph_max_batch: int = 0  # decode steps of up to this many rows from CUDA graphs; 0: eager
    decode_attention: DecodeAttention = "auto"  # how decode reads the KV blocks (docs/engine.md)
    # float32 on the CPU: linear weights reordered once for oneDNN (engine/model/cpu_linear.py),
    # a second copy of them in memory (docs/benchmarks/serving.md#decode-throughput)
    cpu_prepacked_linear: bool = True
    kv_read_delay_s: float = 0.0
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    selection: Selection | None = None  # None: default_selection() of the check layers
    auto_coverage: float = 0.8
    auto_max_ratio: float = 0.5
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    def check_layers_of(self, num_layers: int) -> tuple[int, ...]:
        """The check layers, sorted, for a model of `num_layers` (default_check_layers)."""
        layers = tuple(sorted(set(self.check_layers))) or default_check_layers(num_layers)
        if not all(0 <= layer < num_layers for layer in layers):
            raise ValueError(f"check layers {layers} outside the model's 0..{num_layers - 1}")
        return layers


def prefill_batch_default(device_type: str) -> int:
    """Prefills admitted together run side by side while their prompts total at most this
    many tokens: 2048 on the CPU, where short prompts side by side beat one after another but
    long ones lose (one prompt's forward already keeps the cores busy, and the batch only
    delays the first ones' tokens; docs/engine.md, "Several prefills in one forward").
    16384 on a GPU, where a short prompt leaves it idle."""
    return 2048 if device_type == "cpu" else 16384
