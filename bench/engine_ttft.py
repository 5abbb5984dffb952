"""TTFT of the four modes side by side in one run, on a random-init model of a real shape.

CPU default: a ~124M Llama-shaped model in bfloat16, 6 chunks x 512 tokens + a 32-token
question. On CUDA (`--shape mistral-7b`): Mistral-7B's shape, 16 x 512 chunk tokens (8K).
Prints a table and writes bench/results/engine_ttft[-<device>].csv.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.engine import Engine
from engine.model import LoadedModel, model_fingerprint, parse_dtype
from engine.prompt import PromptLayout
from engine.synthetic import build_tokenizer, model_config
from engine.types import Mode
from kvstore.store import KVStore, KVStoreConfig

SHAPES = {
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
RESULTS = Path(__file__).parent / "results"


def build_engine(shape: str, device: str, dtype: str, memory_budget: int) -> Engine:
    family = "mistral" if shape.startswith("mistral") else "llama"
    tokenizer = build_tokenizer()
    config = model_config(family, vocab_size=32000, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype))
    model.eval().requires_grad_(False)
    fingerprint = model_fingerprint(model)
    loaded = LoadedModel(
        model, tokenizer, fingerprint, torch.device(device), parse_dtype(dtype), f"random:{shape}"
    )
    store = KVStore(
        KVStoreConfig(
            model_fingerprint=fingerprint,
            memory_budget_bytes=memory_budget,
            pin_memory=device == "cuda",
        )
    )
    return Engine(loaded, store)


def random_layout(
    engine: Engine, num_chunks: int, chunk_tokens: int, question_tokens: int, seed: int = 0
) -> PromptLayout:
    rng = random.Random(seed)
    vocab = len(engine.tokenizer)
    special = set(engine.tokenizer.all_special_ids)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.choice([t for t in range(vocab) if t not in special]) for _ in range(n))

    prefix = engine.prompts.build("q", []).prefix
    return PromptLayout(
        prefix, tuple(tokens(chunk_tokens) for _ in range(num_chunks)), tokens(question_tokens)
    )


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ttft(
    engine: Engine, layout: PromptLayout, mode: Mode, ratio: float, repeats: int, device: str
) -> tuple[float, float, int]:
    """Median TTFT (prefill + first token) in seconds, its spread, and tokens recomputed."""
    samples, recomputed = [], 0
    for _ in range(repeats + 1):  # the first run warms up (and fills the prefix cache)
        synchronize(device)
        start = time.perf_counter()
        prefill = engine.prefill_layout(layout, mode, ratio)
        int(prefill.output.logits.argmax())
        synchronize(device)
        samples.append(time.perf_counter() - start)
        recomputed = prefill.usage.recomputed_tokens
    samples = samples[1:]
    return statistics.median(samples), statistics.pstdev(samples), recomputed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", choices=SHAPES, default="mistral-7b" if cuda else "llama-124m")
    parser.add_argument("--chunks", type=int, default=16 if cuda else 6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    engine = build_engine(args.shape, args.device, args.dtype, memory_budget=64 * 1024**3)
    layout = random_layout(engine, args.chunks, args.chunk_tokens, args.question_tokens)
    for tokens in layout.chunks:
        engine.store.put(engine.chunk_key(tokens), engine.compute_chunk_kv(tokens))

    rows = []
    chunk_total = sum(len(c) for c in layout.chunks)
    for mode in (Mode.FULL_PREFILL, Mode.PREFIX_CACHE, Mode.FULL_REUSE, Mode.CACHEBLEND):
        ttft, spread, recomputed = time_ttft(
            engine, layout, mode, args.ratio, args.repeats, args.device
        )
        rows.append(
            {
                "mode": mode.value,
                "ttft_s": ttft,
                "stdev_s": spread,
                "recomputed_fraction": recomputed / chunk_total,
            }
        )
    base = rows[0]["ttft_s"]
    for row in rows:
        row["vs_full_prefill"] = row["ttft_s"] / base

    print(
        f"\n{args.shape} {args.dtype} on {args.device}: {layout.num_tokens} prompt tokens "
        f"({args.chunks} chunks x {args.chunk_tokens} + {args.question_tokens}-token question), "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'mode':<14}{'TTFT s':>10}{'stdev s':>10}{'recomputed':>12}{'vs full':>10}")
    for row in rows:
        print(
            f"{row['mode']:<14}{row['ttft_s']:>10.4f}{row['stdev_s']:>10.4f}"
            f"{row['recomputed_fraction']:>12.1%}{row['vs_full_prefill']:>10.3f}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"engine_ttft-{args.device}.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=["device", "shape", "dtype", "prompt_tokens", *rows[0]]
        )
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    "device": args.device,
                    "shape": args.shape,
                    "dtype": args.dtype,
                    "prompt_tokens": layout.num_tokens,
                    **row,
                }
            )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
