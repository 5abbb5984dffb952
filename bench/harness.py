"""Shared setup of the engine benchmarks: a random-init model of a real shape (or a real
checkpoint), a prompt of random tokens laid out like the engine's, and a timer of medians."""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from paths import results_dir, shown
from transformers import AutoModelForCausalLM

from demo.tiny import build_tokenizer, model_config
from engine.blend.layout import PromptLayout
from engine.engine import Engine
from engine.model.load import LoadedModel, load_model, model_fingerprint, parse_dtype
from kvstore.store import KVStore, KVStoreConfig
from ragblend.model import bundled_model_dtype

SHAPES = {
    # Compute negligible beside launches: the kernel-count proxy (bench/prefill_launches.py).
    "launch-proxy": dict(
        hidden_size=64,
        num_layers=32,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_positions=8192,
    ),
    "llama-124m": dict(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        max_positions=8192,
    ),
    "mistral-7b": dict(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        max_positions=32768,
    ),
}


def write_rows(name: str, rows: list) -> None:
    """Dataclass rows as bench/results/`name` (paths.results_dir), a column per field."""
    path = results_dir() / name
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    print(f"wrote {shown(path)}")


def default_dtype() -> str:
    """bfloat16 on a GPU and on a CPU with bfloat16 matrix units; float32 on other CPUs, where
    torch emulates bfloat16 matmuls hundreds of times slower (the engine's default rule)."""
    return "bfloat16" if torch.cuda.is_available() else bundled_model_dtype()


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Device, model shape and prompt: the CPU workload by default, 8K tokens of a 7B on CUDA."""
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default=default_dtype())
    parser.add_argument("--shape", choices=SHAPES, default="mistral-7b" if cuda else "llama-124m")
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--tag", help="results file tag (default: the --model's name)")
    parser.add_argument("--chunks", type=int, default=16 if cuda else 6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--repeats", type=int, default=5)


MODEL_HELP = (
    "a checkpoint instead of a random-init --shape: anything the engine's --model takes "
    "(a checkpoint directory, a GGUF file, a hub id in the local cache)"
)


def workload_model(args: argparse.Namespace) -> LoadedModel:
    """`--model` loaded as the engine loads it, else a random-init model of `--shape`."""
    if args.model:
        return load_model(args.model, args.device, args.dtype)
    return build_model(args.shape, args.device, args.dtype)


def model_label(args: argparse.Namespace) -> str:
    """The model's name in tables and CSV: the checkpoint's file or folder name, or the shape."""
    return Path(args.model.rstrip("/")).name if args.model else args.shape


def results_name(args: argparse.Namespace, bench: str, suffix: str = "csv") -> str:
    """<bench>-<device>.<suffix>, with `--tag` (or a `--model`'s name) before the device."""
    tag = args.tag or (model_label(args).lower() if args.model else None)
    return f"{bench}-{tag}-{args.device}.{suffix}" if tag else f"{bench}-{args.device}.{suffix}"


def build_model(shape: str, device: str, dtype: str) -> LoadedModel:
    family = "mistral" if shape.startswith("mistral") else "llama"
    tokenizer = build_tokenizer()
    config = model_config(family, vocab_size=32000, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype))
    model.eval().requires_grad_(False)
    return LoadedModel(
        model,
        tokenizer,
        model_fingerprint(model),
        torch.device(device),
        parse_dtype(dtype),
        f"random:{shape}",
    )


def build_store(
    loaded: LoadedModel,
    memory_budget_bytes: int = 64 * 1024**3,
    ssd_path: str | None = None,
    gpu_budget_bytes: int = 0,
    ssd_encoding: str = "none",
) -> KVStore:
    return KVStore(
        KVStoreConfig(
            model_fingerprint=loaded.fingerprint,
            memory_budget_bytes=memory_budget_bytes,
            ssd_path=ssd_path,
            pin_memory=loaded.device.type == "cuda",
            gpu_budget_bytes=gpu_budget_bytes,
            device=str(loaded.device),
            persistent_encoding=ssd_encoding,
        )
    )


def build_engine(
    loaded: LoadedModel,
    memory_budget_bytes: int = 64 * 1024**3,
    ssd_path: str | None = None,
    gpu_budget_bytes: int = 0,
    ssd_encoding: str = "none",
    **options,
) -> Engine:
    """An engine over its own store; a KV pool for one sequence unless `max_num_seqs` says otherwise
    (the prefill benchmarks never serve, and a pool per engine would only take memory)."""
    options.setdefault("max_num_seqs", 1)
    store = build_store(loaded, memory_budget_bytes, ssd_path, gpu_budget_bytes, ssd_encoding)
    return Engine(loaded, store, **options)


def token_sampler(engine: Engine, seed: int = 0) -> Callable[[int], tuple[int, ...]]:
    """`tokens(n)`: n random non-special token ids, reproducible from `seed`."""
    rng = random.Random(seed)
    special = set(engine.tokenizer.all_special_ids)
    choices = [t for t in range(len(engine.tokenizer)) if t not in special]
    return lambda n: tuple(rng.choice(choices) for _ in range(n))


def random_layout(
    engine: Engine, num_chunks: int, chunk_tokens: int, question_tokens: int, seed: int = 0
) -> PromptLayout:
    tokens = token_sampler(engine, seed)

    prefix = engine.prompts.build("q", []).prefix
    return PromptLayout(
        prefix, tuple(tokens(chunk_tokens) for _ in range(num_chunks)), tokens(question_tokens)
    )


def store_chunks(engine: Engine, layout: PromptLayout, fastest_tier: bool = False) -> None:
    """Precompute the layout's chunks into the store (host memory and SSD), or with
    `fastest_tier` into its fastest tier only (the gpu tier when there is one)."""
    for tokens in layout.chunks:
        kv = engine.prefiller.compute_chunk_kv(tokens)
        if fastest_tier:
            engine.store.put_local(engine.chunk_key(tokens), kv)
        else:
            engine.store.put(engine.chunk_key(tokens), kv)
    engine.store.flush()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(
    cases: dict[str, tuple[Callable[[], object], Callable[[], None]]],
    repeats: int,
    device: torch.device,
) -> dict[str, tuple[float, float, object]]:
    """Median and stdev of each case's `run` (after its `before`) over `repeats` rounds, each
    round running every case once in turn after one warm-up round; the last results. Taking
    the cases round-robin makes a machine that speeds up or slows down during the run (the
    shared development VMs do) shift every case alike, so their ratios stay fair."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    results: dict[str, object] = {}
    for round_index in range(repeats + 1):
        for name, (run, before) in cases.items():
            before()
            synchronize(device)
            start = time.perf_counter()
            results[name] = run()
            synchronize(device)
            if round_index:
                samples[name].append(time.perf_counter() - start)
    return {
        name: (statistics.median(times), statistics.pstdev(times), results[name])
        for name, times in samples.items()
    }


def median_seconds(
    run: Callable[[], object],
    repeats: int,
    device: torch.device,
    before: Callable[[], None] = lambda: None,
) -> tuple[float, float, object]:
    """Median and stdev of `run` over `repeats` timed calls after one warm-up; the last result."""
    samples, result = [], None
    for _ in range(repeats + 1):
        before()
        synchronize(device)
        start = time.perf_counter()
        result = run()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    samples = samples[1:]
    return statistics.median(samples), statistics.pstdev(samples), result
