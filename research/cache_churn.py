"""Hit rate and blended TTFT of the in-memory tiers' eviction policies (LRU vs W-TinyLFU) under
cache churn: Zipf-popular chunks mixed with a stream of one-off chunks, and without that stream.

    .venv/bin/python research/cache_churn.py            # 120k requests, both policies, churn on/off
    .venv/bin/python research/cache_churn.py --quick    # a few seconds

Drives the real `MemoryTier` (kvstore/memory_tier.py) with every policy of kvstore/eviction.py
side by side on the same request trace. The tier measures an entry by `ChunkKV.nbytes`, so each
chunk is one shared 1-element float32 ChunkKV (8 bytes): the policies see keys and byte sizes
only, and real-size tensors would change nothing but the run time.

Workload: chunk popularity is Zipf(`--zipf`) over `--chunks` chunk keys. A request is
`--chunks-per-request` distinct keys. With churn, `--churn-share` of the requests, at random
places in the trace, are one-off requests (all their keys new, never seen again) and the rest
Zipf requests (distinct Zipf draws), so that share of requests, and of chunk lookups, is one-off.
The tier's budget is `--tier-share` of the Zipf working set's bytes (all chunks the same size).
Each request looks up all its chunks, then puts the ones it missed, as the engine's write-back
stores a request's recomputed chunks after its prefill (tinylfu may turn them away). The first
`--warmup-share` of requests warm the tier and are not measured.

TTFT model: a request's TTFT interpolates linearly between all-miss (full prefill) and all-hit
(cacheblend) by its fraction of chunks hit, with the CPU figures of
bench/results/engine_ttft-cpu.csv (rows mode=full_prefill and mode=cacheblend, tier=memory:
6 x 512 chunk tokens + the question). Every request has the same number of chunks, so the mean
TTFT is that interpolation at the hit rate; it is reported to put the hit rates in seconds.

Prints a markdown table, writes bench/results/cache_churn.csv and bench/results/cache_churn.md,
and docs/cache_churn.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.paths import COMMITTED_RESULTS, plots_dir, results_dir, shown  # noqa: E402
from kvstore.eviction import POLICIES, PolicyName  # noqa: E402
from kvstore.memory_tier import MemoryTier  # noqa: E402
from kvstore.types import ChunkKV  # noqa: E402

TTFT_CSV = COMMITTED_RESULTS / "engine_ttft-cpu.csv"
ALL_MISS_MODE, ALL_HIT_MODE = "full_prefill", "cacheblend"
# The targets: tinylfu's hit rate over lru's, with churn and without.
TARGETS = {True: 1.5, False: 1.0}
QUICK_REQUESTS = 5_000
# About 20 s of one CPU core for the four runs (tinylfu hashes every access).
DEFAULT_REQUESTS = 120_000


@dataclass(frozen=True)
class Workload:
    requests: int
    chunks: int
    zipf: float
    churn_share: float
    tier_share: float
    chunks_per_request: int
    warmup_share: float
    seed: int


@dataclass(frozen=True)
class TTFTModel:
    all_miss_s: float
    all_hit_s: float
    source: str

    def ttft(self, hit_fraction: float) -> float:
        return self.all_miss_s + (self.all_hit_s - self.all_miss_s) * hit_fraction


@dataclass(frozen=True)
class RunResult:
    policy: str
    churn: bool
    churn_share: float
    requests_measured: int
    lookups: int
    hits: int
    hit_rate: float
    mean_ttft_s: float
    top_n_hit_rate: float
    tier_entries: int
    run_s: float


@dataclass(frozen=True)
class Row(RunResult):
    hit_rate_vs_lru: float
    target_vs_lru: float | None
    target_met: bool | None


def load_ttft_model(path: Path = TTFT_CSV) -> TTFTModel:
    """The all-miss and all-hit TTFT from the engine_ttft CPU results (memory tier rows)."""
    with path.open() as f:
        rows = {r["mode"]: r for r in csv.DictReader(f) if r["tier"] == "memory"}
    miss, hit = rows[ALL_MISS_MODE], rows[ALL_HIT_MODE]
    source = (
        f"{shown(path)}: {miss['shape']}, {miss['dtype']}, "
        f"{miss['prompt_tokens']} prompt tokens, mode={ALL_MISS_MODE} and mode={ALL_HIT_MODE}"
    )
    return TTFTModel(float(miss["ttft_s"]), float(hit["ttft_s"]), source)


def zipf_requests(rng: np.random.Generator, w: Workload, count: int) -> np.ndarray:
    """`count` rows of distinct Zipf ranks (0 most popular)."""
    weights = 1.0 / np.arange(1, w.chunks + 1) ** w.zipf
    cdf = np.cumsum(weights / weights.sum())
    rows = np.empty((count, w.chunks_per_request), dtype=np.int64)
    todo = np.arange(count)
    # Redraw whole rows that repeat a key (a request retrieves a chunk once): the rows are Zipf
    # draws conditioned on being distinct, which flattens the top ranks a little.
    while todo.size:
        draws = np.searchsorted(cdf, rng.random((todo.size, w.chunks_per_request)))
        rows[todo] = np.minimum(draws, w.chunks - 1)
        ordered = np.sort(rows[todo], axis=1)
        todo = todo[(np.diff(ordered, axis=1) == 0).any(axis=1)]
    return rows


def build_trace(w: Workload, churn: bool) -> np.ndarray:
    """Requests x chunk ids: Zipf ranks below `w.chunks`, one-off ids from `w.chunks` up."""
    rng = np.random.default_rng([w.seed, int(churn)])
    trace = zipf_requests(rng, w, w.requests)
    if churn:
        one_off = rng.permutation(w.requests) < round(w.churn_share * w.requests)
        fresh = w.chunks + np.arange(one_off.sum() * w.chunks_per_request)
        trace[one_off] = fresh.reshape(-1, w.chunks_per_request)
    return trace


def top_n_hit_rate(measured: np.ndarray, entries: int) -> float:
    """The hit rate of a tier that held the `entries` most popular chunks all along: a
    reference no policy learning popularity online should beat by more than noise."""
    return float((measured < entries).mean())


def chunk_kv() -> ChunkKV:
    return ChunkKV(keys=torch.zeros(1, 1, 1, 1), values=torch.zeros(1, 1, 1, 1))


def request_hits(tier: MemoryTier, keys: list[str], kv: ChunkKV) -> int:
    """Look every chunk up, then write back the misses; the number of hits."""
    missed = [key for key in keys if tier.get(key) is None]
    for key in missed:
        tier.put(key, kv)
    return len(keys) - len(missed)


def keyed(trace: np.ndarray) -> Iterator[list[str]]:
    for row in trace.tolist():
        yield [f"c{chunk}" for chunk in row]


def run_policy(
    policy: PolicyName, w: Workload, trace: np.ndarray, churn: bool, model: TTFTModel
) -> RunResult:
    kv = chunk_kv()
    budget = int(w.tier_share * w.chunks) * kv.nbytes
    tier = MemoryTier(budget, policy=policy)
    warmup = int(w.warmup_share * len(trace))
    started = time.process_time()
    hits = 0
    for index, keys in enumerate(keyed(trace)):
        got = request_hits(tier, keys, kv)
        if index >= warmup:
            hits += got
    run_s = time.process_time() - started
    measured = len(trace) - warmup
    lookups = measured * w.chunks_per_request
    hit_rate = hits / lookups
    return RunResult(
        policy=policy,
        churn=churn,
        churn_share=w.churn_share if churn else 0.0,
        requests_measured=measured,
        lookups=lookups,
        hits=hits,
        hit_rate=hit_rate,
        mean_ttft_s=model.ttft(hit_rate),
        top_n_hit_rate=top_n_hit_rate(trace[warmup:], budget // kv.nbytes),
        tier_entries=tier.stats().entries or 0,
        run_s=run_s,
    )


def with_ratios(results: list[RunResult]) -> list[Row]:
    lru = {r.churn: r.hit_rate for r in results if r.policy == "lru"}
    rows = []
    for r in results:
        ratio = r.hit_rate / lru[r.churn] if lru[r.churn] else float("nan")
        target = TARGETS[r.churn] if r.policy == "tinylfu" else None
        met = None if target is None else ratio >= target
        rows.append(Row(**asdict(r), hit_rate_vs_lru=ratio, target_vs_lru=target, target_met=met))
    return rows


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| policy | churn | requests measured | lookups | hit rate | vs lru | target | "
        "mean TTFT (s) | top-N pinned | of top-N |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        churn = f"{r.churn_share:.0%} one-off" if r.churn else "none"
        if r.target_vs_lru is None:
            target = ""
        else:
            target = f">= {r.target_vs_lru:.1f}x: {'met' if r.target_met else 'MISSED'}"
        lines.append(
            f"| {r.policy} | {churn} | {r.requests_measured:,} | {r.lookups:,} | "
            f"{r.hit_rate:.3f} | {r.hit_rate_vs_lru:.3f}x | {target} | {r.mean_ttft_s:.3f} | "
            f"{r.top_n_hit_rate:.3f} | {r.hit_rate / r.top_n_hit_rate:.0%} |"
        )
    return "\n".join(lines)


def write_csv(rows: list[Row], path: Path) -> None:
    names = [f.name for f in fields(Row)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in rows:
            values = asdict(r)
            for name in ("hit_rate", "mean_ttft_s", "hit_rate_vs_lru", "top_n_hit_rate", "run_s"):
                values[name] = round(values[name], 4)
            writer.writerow(values)


def write_markdown(
    rows: list[Row], w: Workload, model: TTFTModel, command: str, path: Path
) -> None:
    entries = int(w.tier_share * w.chunks)
    text = f"""# Memory tier eviction policies under cache churn

`research/cache_churn.py` drives the real `MemoryTier` with each policy of `kvstore/eviction.py`
on the same seeded request trace.

    {command}

Setup: chunk popularity Zipf(s={w.zipf}) over {w.chunks:,} chunks; a request is
{w.chunks_per_request} distinct chunks. With churn, {w.churn_share:.0%} of the requests, at random
places in the trace, are one-off requests (all their chunks new, each seen once) and the rest
Zipf requests, so {w.churn_share:.0%} of chunk lookups are one-off. Tier budget:
{w.tier_share:.0%} of the Zipf working set ({entries:,} chunks; every chunk the same size).
Each request looks up its chunks, then puts the misses (the engine's write-back).
{w.requests:,} requests, seed {w.seed}; the first {w.warmup_share:.0%} warm the tier and are not
measured.

Mean TTFT: each request's TTFT interpolated linearly by its fraction of chunks hit between
all-miss {model.all_miss_s:.3f} s and all-hit {model.all_hit_s:.3f} s ({model.source}).
Targets: tinylfu/lru hit rate >= {TARGETS[True]}x with churn, >= {TARGETS[False]}x without.
"top-N pinned" is the hit rate of a tier holding the {entries:,} most popular chunks all along
(one-off chunks always miss), a reference for what a popularity-aware policy can reach; "of
top-N" is a policy's hit rate as a share of it.

{markdown_table(rows)}
"""
    path.write_text(text)


def plot(rows: list[Row], w: Workload, path: Path) -> bool:
    """Hit rate by policy, with churn and without, beside the top-N reference; False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    groups = [True, False]
    bars = [*POLICIES, "top-N pinned"]
    width = 0.8 / len(bars)
    for i, name in enumerate(bars):
        heights = []
        for churn in groups:
            # The top-N reference is the same for every policy's row: read it from lru's.
            policy = name if name in POLICIES else "lru"
            row = next(r for r in rows if r.churn == churn and r.policy == policy)
            heights.append(row.hit_rate if name in POLICIES else row.top_n_hit_rate)
        xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, heights, width, label=name)
        for x, h in zip(xs, heights, strict=True):
            ax.text(x, h + 0.01, f"{h:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{w.churn_share:.0%} one-off requests", "no churn"])
    ax.set_ylabel("chunk hit rate")
    ax.set_title(
        f"Zipf({w.zipf}) over {w.chunks:,} chunks, tier budget {w.tier_share:.0%} of them",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--chunks", type=int, default=10_000, help="Zipf-popular chunk keys")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s")
    parser.add_argument("--churn-share", type=float, default=0.5, help="one-off request share")
    parser.add_argument("--tier-share", type=float, default=0.05, help="budget / working set")
    parser.add_argument("--chunks-per-request", type=int, default=6)
    parser.add_argument("--warmup-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS:,} requests")
    parser.add_argument("--csv", type=Path, default=results_dir() / "cache_churn.csv")
    parser.add_argument("--md", type=Path, default=results_dir() / "cache_churn.md")
    parser.add_argument(
        "--plot", type=Path, default=plots_dir() / "cache_churn.png", help="PNG (needs matplotlib)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    w = Workload(
        requests=QUICK_REQUESTS if args.quick else args.requests,
        chunks=args.chunks,
        zipf=args.zipf,
        churn_share=args.churn_share,
        tier_share=args.tier_share,
        chunks_per_request=args.chunks_per_request,
        warmup_share=args.warmup_share,
        seed=args.seed,
    )
    model = load_ttft_model()
    results = []
    for churn in (True, False):
        trace = build_trace(w, churn)
        results.extend(run_policy(p, w, trace, churn, model) for p in POLICIES)
    rows = with_ratios(results)
    print(markdown_table(rows))
    command = " ".join([".venv/bin/python research/cache_churn.py", *(argv or sys.argv[1:])])
    write_csv(rows, args.csv)
    write_markdown(rows, w, model, command, args.md)
    plotted = plot(rows, w, args.plot)
    written = [args.csv, args.md, *([args.plot] if plotted else [])]
    print(f"\nwrote {' and '.join(map(shown, written))}")


if __name__ == "__main__":
    main()
