"""Serving benchmark of the continuous-batching engine: TTFT under Poisson load, batched decode
throughput, and decode step time against context length. A benchmark, never run as a test.

One run, one loaded model (random init of a real shape) and one KV store shared by every engine:

1. Serving. Each request is 6 chunks x 512 tokens drawn from a pool of precomputed chunks
   (KV in the memory tier) plus a random 32-token question, and decodes 32 tokens
   (ignore_eos). full_prefill and cacheblend (r = 0.15), each with the batching scheduler
   (max_num_seqs 16) and with max_num_seqs = 1 (one sequence at a time). Each mode's unloaded
   TTFT is measured first (requests one at a time); the request rates are fractions of
   1 / unloaded TTFT. Every point is bounded by a request count and a time limit; requests
   still unanswered when the point ends are cancelled and count with the TTFT they had
   reached (a lower bound). Reports TTFT p50/p99, queue p50, tokens/s, completed, refused
   (QueueFullError, the service's 429), and the highest rate each (mode, scheduler) sustains
   with TTFT p50 <= 2x its unloaded TTFT.
2. Decode throughput: one batched decode step (`engine.runner.decode`) at 1, 4, 16 and 64
   sequences of ~3.2K context, tokens/s and the ratio to batch 1.
3. Decode step time at 8K context vs 1K (batch 1 and 16), beside the time of the attention
   reads alone and of the per-token KV concatenation a growing cache would add.

CPU default: llama-124m shape in bfloat16; `--device cuda`: mistral-7b shape. Writes
bench/results/serving-<device>[-decode|-steps|-summary].csv, bench/results/serving-<device>.md
and docs/serving-<device>.png (`--quick`: a ~1 minute smoke run, files tagged -quick).
"""

from __future__ import annotations

import os

# A CPU shared with other processes: OpenMP threads that spin at every barrier stall behind
# the other processes' threads (small decode matmuls took 5x longer); passive waits do not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import csv  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import (
    MODEL_HELP,
    SHAPES,
    build_store,
    median_seconds,
    store_chunks,
    synchronize,
    token_sampler,
    workload_model,
)

from engine.engine import Engine
from engine.errors import QueueFullError
from engine.layers import LayerOps
from engine.prompt import PromptLayout
from engine.runner import pool_bytes
from engine.types import GenerateRequest, GenerateResult, Mode, TokenDelta

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
MODES = (Mode.FULL_PREFILL, Mode.CACHEBLEND)


# -- workload --------------------------------------------------------------------------------


@dataclass
class Workload:
    """A pool of precomputed chunks and, per request index, its layout: the same sequence of
    requests (and arrival gaps) at every point, so the configurations see identical load."""

    layouts: list[PromptLayout]
    gaps: list[float]  # inter-arrival times of a Poisson process of rate 1

    def arrivals(self, rate: float, count: int) -> list[float]:
        times, now = [], 0.0
        for gap in self.gaps[:count]:
            now += gap / rate
            times.append(now)
        return times


def build_workload(engine: Engine, args: argparse.Namespace, count: int) -> Workload:
    tokens = token_sampler(engine, seed=1)
    pool = [tokens(args.chunk_tokens) for _ in range(args.pool_chunks)]
    prefix = engine.prompts.build("q", []).prefix
    store_chunks(engine, PromptLayout(prefix, tuple(pool), ()))
    rng = random.Random(2)
    layouts = [
        PromptLayout(
            prefix,
            tuple(rng.sample(pool, args.chunks)),
            tokens(args.question_tokens),
        )
        for _ in range(count)
    ]
    gaps = [rng.expovariate(1.0) for _ in range(count)]
    return Workload(layouts, gaps)


def request_for(mode: Mode, args: argparse.Namespace) -> GenerateRequest:
    return GenerateRequest(
        question="benchmark",
        mode=mode,
        recompute_ratio=args.ratio if mode is Mode.CACHEBLEND else None,
        max_tokens=args.output_tokens,
        ignore_eos=True,
    )


# -- serving under Poisson load ------------------------------------------------------------


@dataclass
class Outcome:
    arrival_s: float
    first_token_s: float | None = None
    result: GenerateResult | None = None
    refused: bool = False
    error: str | None = None
    end_s: float = math.inf  # when the point stopped waiting for it


@dataclass
class Point:
    mode: str
    scheduler: str
    max_num_seqs: int
    rate_fraction: float
    rate: float
    sent: int = 0
    completed: int = 0
    refused: int = 0
    unfinished: int = 0
    errors: int = 0
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    queue_p50_s: float = math.nan
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    mean_decode_batch: float = math.nan
    elapsed_s: float = 0.0
    sustained: bool = False
    ttft_samples: list[float] = field(default_factory=list, repr=False)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


async def one_request(
    engine: Engine, request: GenerateRequest, layout: PromptLayout, outcome: Outcome
) -> None:
    try:
        generation = engine.start(request, layout=layout)
    except QueueFullError:
        outcome.refused = True
        return
    try:
        async for event in generation:
            if isinstance(event, TokenDelta) and outcome.first_token_s is None:
                outcome.first_token_s = time.perf_counter()
            elif isinstance(event, GenerateResult):
                outcome.result = event
    except asyncio.CancelledError:
        generation.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - a benchmark counts failures, it does not stop
        outcome.error = f"{type(exc).__name__}: {exc}"


async def run_point(
    engine: Engine,
    workload: Workload,
    mode: Mode,
    args: argparse.Namespace,
    rate: float,
    decode_batches: list[int],
) -> tuple[list[Outcome], float]:
    """Send Poisson arrivals until the request count or the time limit, then wait up to the
    drain limit for the answers; cancel what is left. Returns outcomes and elapsed seconds."""
    request = request_for(mode, args)
    arrivals = [t for t in workload.arrivals(rate, args.requests) if t <= args.time_limit_s]
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task] = []
    decode_batches.clear()
    start = time.perf_counter()
    for index, at in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        outcome = Outcome(arrival_s=time.perf_counter())
        outcomes.append(outcome)
        layout = workload.layouts[index]
        tasks.append(asyncio.create_task(one_request(engine, request, layout, outcome)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=args.drain_s)
        end = time.perf_counter()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    else:
        end = time.perf_counter()
    # Cancelled sequences leave at the engine's next step: wait for it to be idle.
    while engine.num_running or engine.num_waiting:
        await asyncio.sleep(0.01)
    for outcome in outcomes:
        outcome.end_s = end
    return outcomes, end - start


def summarise(point: Point, outcomes: list[Outcome], elapsed_s: float, unloaded_s: float) -> None:
    ttfts, queues, tokens = [], [], 0
    for o in outcomes:
        if o.refused:
            point.refused += 1
            continue
        if o.error is not None:
            point.errors += 1
            continue
        if o.result is not None:
            point.completed += 1
            ttfts.append(o.result.timings.ttft_s)
            queues.append(o.result.timings.queue_s)
            tokens += o.result.usage.completion_tokens
            continue
        point.unfinished += 1
        # Unanswered at the end of the point: the TTFT it reached is a lower bound.
        seen = o.first_token_s if o.first_token_s is not None else o.end_s
        ttfts.append(seen - o.arrival_s)
    point.sent = len(outcomes)
    point.ttft_samples = ttfts
    point.ttft_p50_s = percentile(ttfts, 50)
    point.ttft_p99_s = percentile(ttfts, 99)
    point.queue_p50_s = percentile(queues, 50)
    point.elapsed_s = elapsed_s
    point.tokens_per_s = tokens / elapsed_s if elapsed_s else 0.0
    point.requests_per_s = point.completed / elapsed_s if elapsed_s else 0.0
    point.sustained = point.ttft_p50_s <= 2 * unloaded_s and point.refused == 0


def measure_unloaded(
    engine: Engine, workload: Workload, mode: Mode, args: argparse.Namespace
) -> tuple[float, float]:
    """Median TTFT and total time of requests sent one at a time (after one warm-up)."""
    request = request_for(mode, args)
    ttfts, totals = [], []
    for index in range(args.unloaded_requests + 1):
        result = engine.generate(request, layout=workload.layouts[-1 - index])
        if index:
            ttfts.append(result.timings.ttft_s)
            totals.append(result.timings.total_s)
    return statistics.median(ttfts), statistics.median(totals)


def sustained_rate(points: list[Point], unloaded_s: float) -> tuple[float, str]:
    """The highest rate with TTFT p50 <= 2x unloaded, interpolated linearly (in rate) between
    the last passing point and the first failing one; '>=' when every point passes."""
    points = sorted(points, key=lambda p: p.rate)
    limit = 2 * unloaded_s
    last = None
    for p in points:
        if not p.sustained:
            if last is None:
                return points[0].rate, "<"
            if p.ttft_p50_s <= limit:  # failed on refusals only
                return last.rate, "="
            span = (limit - last.ttft_p50_s) / (p.ttft_p50_s - last.ttft_p50_s)
            return last.rate + span * (p.rate - last.rate), "~"
        last = p
    return points[-1].rate, ">="


def serving(
    loaded, store, args: argparse.Namespace, notes: list[str]
) -> tuple[list[Point], list[dict]]:
    schedulers = [("batching", args.max_num_seqs), ("one-at-a-time", 1)]
    schedulers = [s for s in schedulers if s[0] in args.schedulers]
    points: list[Point] = []
    summary: list[dict] = []
    unloaded: dict[Mode, tuple[float, float]] = {}
    workload = None
    decode_batches: list[int] = []
    for scheduler, max_num_seqs in schedulers:
        for mode in [m for m in MODES if m.value in args.modes]:
            engine = Engine(
                loaded,
                store,
                max_num_seqs=max_num_seqs,
                max_model_len=args.serving_model_len,
                max_waiting=args.max_waiting,
            )
            engine.add_step_listener(
                lambda r: decode_batches.append(r.num_seqs) if not r.is_prefill else None
            )
            try:
                if workload is None:
                    workload = build_workload(engine, args, args.requests + 32)
                    notes.append(
                        f"prompt {workload.layouts[0].num_tokens} tokens ({args.chunks} of "
                        f"{args.pool_chunks} pooled chunks x {args.chunk_tokens} + "
                        f"{args.question_tokens}-token question), {args.output_tokens} output "
                        f"tokens; KV slots {engine.runner.num_slots} x {engine.max_model_len}"
                    )
                if mode not in unloaded:
                    unloaded[mode] = measure_unloaded(engine, workload, mode, args)
                    ttft, total = unloaded[mode]
                    print(f"unloaded {mode.value}: TTFT {ttft:.3f} s, request {total:.3f} s")
                else:
                    engine.generate(request_for(mode, args), layout=workload.layouts[-1])
                unloaded_ttft = unloaded[mode][0]
                config_points = []
                for fraction in args.rate_fractions:
                    rate = fraction / unloaded_ttft
                    point = Point(mode.value, scheduler, max_num_seqs, fraction, rate)
                    outcomes, elapsed = asyncio.run(
                        run_point(engine, workload, mode, args, rate, decode_batches)
                    )
                    summarise(point, outcomes, elapsed, unloaded_ttft)
                    if decode_batches:
                        point.mean_decode_batch = statistics.mean(decode_batches)
                    config_points.append(point)
                    print(
                        f"  {mode.value:<13}{scheduler:<14}{rate:7.3f}/s  sent {point.sent:3d} "
                        f"done {point.completed:3d} refused {point.refused:2d} "
                        f"TTFT p50 {point.ttft_p50_s:7.3f} p99 {point.ttft_p99_s:7.3f}  "
                        f"{point.tokens_per_s:6.1f} tok/s  {elapsed:5.1f} s",
                        flush=True,
                    )
                points += config_points
                rate, how = sustained_rate(config_points, unloaded_ttft)
                summary.append(
                    {
                        "mode": mode.value,
                        "scheduler": scheduler,
                        "max_num_seqs": max_num_seqs,
                        "unloaded_ttft_s": unloaded_ttft,
                        "unloaded_request_s": unloaded[mode][1],
                        "sustained_rate": rate,
                        "sustained_how": how,
                    }
                )
            finally:
                engine.close()
                del engine
                gc.collect()
    return points, summary


# -- decode micro-benchmarks -----------------------------------------------------------------


def _decode_engine(loaded, store, num_seqs: int, model_len: int) -> Engine:
    """An engine whose pool holds exactly `num_seqs` slots of `model_len` positions."""
    need = pool_bytes(LayerOps(loaded.model), num_seqs, model_len)
    return Engine(loaded, store, max_num_seqs=num_seqs, max_model_len=model_len, kv_pool_bytes=need)


def decode_step_seconds(
    engine: Engine, batch: int, context: int, repeats: int
) -> tuple[float, float]:
    rng = random.Random(batch)
    slots, positions = list(range(batch)), [context] * batch
    tokens = [rng.randrange(1000, 30000) for _ in range(batch)]
    seconds, spread, _ = median_seconds(
        lambda: engine.runner.decode(slots, positions, tokens), repeats, engine.device
    )
    return seconds, spread


def decode_throughput(loaded, store, args: argparse.Namespace, notes: list[str]) -> list[dict]:
    engine = _decode_engine(loaded, store, max(args.decode_batches), args.decode_model_len)
    rows = []
    try:
        notes.append(
            f"decode: {engine.runner.num_slots} slots x {engine.max_model_len} positions, "
            f"pool {2 * engine.runner.keys.nbytes / 2**30:.2f} GiB"
        )
        for batch in args.decode_batches:
            if batch > engine.runner.num_slots:
                print(f"skip batch {batch}: only {engine.runner.num_slots} slots fit")
                continue
            seconds, spread = decode_step_seconds(
                engine, batch, args.decode_context, args.decode_repeats
            )
            rows.append(
                {
                    "batch": batch,
                    "context": args.decode_context,
                    "step_s": seconds,
                    "stdev_s": spread,
                    "tokens_per_s": batch / seconds,
                }
            )
            print(f"  decode batch {batch:3d}: {seconds * 1e3:8.2f} ms/step", flush=True)
    finally:
        engine.close()
        del engine
        gc.collect()
    for row in rows:
        row["vs_batch_1"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def attention_and_copy_seconds(
    engine: Engine, batch: int, context: int, repeats: int
) -> tuple[float, float]:
    """Seconds of the decode step's attention reads alone (every layer, same shapes as the
    runner's), and of one torch.cat of the context KV per layer (what a cache that grows by
    concatenation, as transformers' DynamicCache, adds to every token)."""
    runner = engine.runner
    shape = engine.ops.shape
    keys, values = runner.keys, runner.values
    q = torch.randn(
        batch,
        shape.num_kv_heads,
        runner.group,
        shape.head_dim,
        dtype=keys.dtype,
        device=keys.device,
    )
    mask = torch.ones(batch, 1, 1, context + 1, dtype=torch.bool, device=keys.device)
    new = torch.zeros(
        batch, shape.num_kv_heads, 1, shape.head_dim, dtype=keys.dtype, device=keys.device
    )

    @torch.inference_mode()
    def attention():
        for i in range(shape.num_layers):
            F.scaled_dot_product_attention(
                q,
                keys[i][:batch, :, : context + 1],
                values[i][:batch, :, : context + 1],
                attn_mask=mask,
                scale=shape.head_dim**-0.5,
            )

    @torch.inference_mode()
    def concatenate():
        for i in range(shape.num_layers):
            torch.cat([keys[i][:batch, :, :context], new], dim=2)
            torch.cat([values[i][:batch, :, :context], new], dim=2)

    attn, _, _ = median_seconds(attention, repeats, engine.device)
    copy, _, _ = median_seconds(concatenate, repeats, engine.device)
    return attn, copy


def step_time_vs_context(loaded, store, args: argparse.Namespace) -> list[dict]:
    long_context = args.long_context
    model_len = long_context + 1
    engine = _decode_engine(loaded, store, max(args.step_batches), model_len)
    rows = []
    try:
        for batch in args.step_batches:
            for context in (args.short_context, long_context):
                step, spread = decode_step_seconds(engine, batch, context, args.decode_repeats)
                attn, copy = attention_and_copy_seconds(engine, batch, context, args.decode_repeats)
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "step_s": step,
                        "stdev_s": spread,
                        "attention_s": attn,
                        "step_minus_attention_s": step - attn,
                        "kv_concat_s": copy,
                        "kv_bytes_read": 2
                        * engine.ops.shape.num_layers
                        * batch
                        * engine.ops.shape.num_kv_heads
                        * (context + 1)
                        * engine.ops.shape.head_dim
                        * engine.runner.keys.element_size(),
                    }
                )
                print(
                    f"  step batch {batch:2d} context {context:5d}: {step * 1e3:8.2f} ms, "
                    f"attention {attn * 1e3:8.2f} ms, concat {copy * 1e3:8.2f} ms",
                    flush=True,
                )
    finally:
        engine.close()
        del engine
        gc.collect()
    return rows


# -- output ----------------------------------------------------------------------------------


def write_csv(path: Path, rows: list[dict], extra: dict) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*extra, *rows[0]])
        writer.writeheader()
        for row in rows:
            writer.writerow({**extra, **row})
    print(f"wrote {path.relative_to(ROOT)}")


def point_row(p: Point) -> dict:
    row = {k: v for k, v in vars(p).items() if k != "ttft_samples"}
    return row


def markdown(
    points: list[Point],
    summary: list[dict],
    decode: list[dict],
    steps: list[dict],
    header: list[str],
) -> str:
    out = [*header, ""]
    if summary:
        out += [
            "### Serving: TTFT under Poisson load",
            "",
            "| mode | scheduler | rate (req/s) | x 1/unloaded TTFT | sent | completed | refused "
            "| unfinished | TTFT p50 (s) | TTFT p99 (s) | queue p50 (s) | tokens/s "
            "| mean decode batch | p50 <= 2x unloaded |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for p in points:
            out.append(
                f"| {p.mode} | {p.scheduler} | {p.rate:.3f} | {p.rate_fraction:.2f} | {p.sent} "
                f"| {p.completed} | {p.refused} | {p.unfinished} | {p.ttft_p50_s:.3f} "
                f"| {p.ttft_p99_s:.3f} | {p.queue_p50_s:.3f} | {p.tokens_per_s:.1f} "
                f"| {p.mean_decode_batch:.1f} | {'yes' if p.sustained else 'no'} |"
            )
        out += [
            "",
            "### Highest sustained rate (TTFT p50 <= 2x unloaded TTFT)",
            "",
            "| mode | scheduler | unloaded TTFT (s) | unloaded request (s) | sustained rate "
            "(req/s) | cacheblend / full_prefill |",
            "|---|---|---:|---:|---:|---:|",
        ]
        by = {(s["mode"], s["scheduler"]): s for s in summary}
        for s in summary:
            full = by.get(("full_prefill", s["scheduler"]))
            ratio = ""
            if s["mode"] == "cacheblend" and full:
                ratio = f"{s['sustained_rate'] / full['sustained_rate']:.2f}x"
            how = "" if s["sustained_how"] == "~" else s["sustained_how"] + " "
            out.append(
                f"| {s['mode']} | {s['scheduler']} | {s['unloaded_ttft_s']:.3f} "
                f"| {s['unloaded_request_s']:.3f} | {how}{s['sustained_rate']:.3f} | {ratio} |"
            )
        out += [
            "",
            "Sustained rate: interpolated linearly between the last point that meets the bound "
            "and the first that does not ('>=': every point met it; '<': none did).",
        ]
    if decode:
        out += [
            "",
            f"### Decode throughput, context {decode[0]['context']} tokens",
            "",
            "| concurrent sequences | step (ms) | tokens/s | vs batch 1 |",
            "|---:|---:|---:|---:|",
        ]
        for r in decode:
            out.append(
                f"| {r['batch']} | {r['step_s'] * 1e3:.2f} | {r['tokens_per_s']:.1f} "
                f"| {r['vs_batch_1']:.2f}x |"
            )
    if steps:
        out += [
            "",
            "### Decode step time vs context",
            "",
            "| batch | context | step (ms) | attention reads (ms) | step - attention (ms) "
            "| KV read (MiB) | a per-token KV concat would add (ms) |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in steps:
            out.append(
                f"| {r['batch']} | {r['context']} | {r['step_s'] * 1e3:.2f} "
                f"| {r['attention_s'] * 1e3:.2f} | {r['step_minus_attention_s'] * 1e3:.2f} "
                f"| {r['kv_bytes_read'] / 2**20:.1f} | {r['kv_concat_s'] * 1e3:.2f} |"
            )
        out.append("")
        for batch in sorted({r["batch"] for r in steps}):
            short, long = [r for r in steps if r["batch"] == batch]
            out.append(
                f"- batch {batch}: step {long['context']}/{short['context']} = "
                f"{long['step_s'] / short['step_s']:.2f}x; step grew "
                f"{(long['step_s'] - short['step_s']) * 1e3:.2f} ms, attention reads grew "
                f"{(long['attention_s'] - short['attention_s']) * 1e3:.2f} ms, the rest "
                f"(projections, MLP, LM head, mask) changed "
                f"{(long['step_minus_attention_s'] - short['step_minus_attention_s']) * 1e3:+.2f}"
                f" ms; a per-token concat of the {long['context']}-token KV would add "
                f"{long['kv_concat_s'] * 1e3:.2f} ms."
            )
    return "\n".join(out) + "\n"


def plot(points: list[Point], summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    colors = {
        ("full_prefill", "batching"): "tab:red",
        ("full_prefill", "one-at-a-time"): "tab:orange",
        ("cacheblend", "batching"): "tab:blue",
        ("cacheblend", "one-at-a-time"): "tab:cyan",
    }
    for ax, key, name in ((axes[0], "ttft_p50_s", "p50"), (axes[1], "ttft_p99_s", "p99")):
        for (mode, scheduler), color in colors.items():
            series = sorted(
                (p for p in points if p.mode == mode and p.scheduler == scheduler),
                key=lambda p: p.rate,
            )
            if not series:
                continue
            ax.plot(
                [p.rate for p in series],
                [getattr(p, key) for p in series],
                marker="o",
                color=color,
                linestyle="-" if scheduler == "batching" else "--",
                label=f"{mode}, {scheduler}",
            )
        for s in summary:
            if s["scheduler"] == "batching":
                color = colors[(s["mode"], "batching")]
                ax.axhline(2 * s["unloaded_ttft_s"], color=color, linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(f"TTFT {name}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("TTFT (s, queueing included)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title + "  (dotted: 2x unloaded TTFT)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT)}")


# -- main ------------------------------------------------------------------------------------


def _read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _number(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(value, value)


def rebuild_from_csv(tag: str) -> None:
    """Tables and plot from bench/results/serving-<tag>*.csv; the header of the existing .md
    (everything before the first table) is kept."""
    drop = ("device", "shape", "dtype")
    raw = _read_csv(RESULTS / f"serving-{tag}.csv")
    extra = {k: v for k, v in raw[0].items() if k in drop} if raw else {}
    rows = [{k: _number(v) for k, v in r.items() if k not in drop} for r in raw]
    points = [Point(**r) for r in rows]
    summary = [
        {k: _number(v) for k, v in r.items() if k not in drop}
        for r in _read_csv(RESULTS / f"serving-{tag}-summary.csv")
    ]
    for s in summary:
        mine = [p for p in points if p.mode == s["mode"] and p.scheduler == s["scheduler"]]
        for p in mine:
            p.sustained = p.ttft_p50_s <= 2 * s["unloaded_ttft_s"] and p.refused == 0
        s["sustained_rate"], s["sustained_how"] = sustained_rate(mine, s["unloaded_ttft_s"])
    points.sort(key=lambda p: (p.scheduler != "batching", p.mode != "full_prefill", p.rate))
    decode, steps = (
        [
            {k: _number(v) for k, v in r.items() if k not in drop}
            for r in _read_csv(RESULTS / f"serving-{tag}-{part}.csv")
        ]
        for part in ("decode", "steps")
    )
    md = RESULTS / f"serving-{tag}.md"
    header = md.read_text().split("\n### ")[0].rstrip("\n").split("\n") if md.exists() else []
    md.write_text(markdown(points, summary, decode, steps, header))
    print(f"wrote {md.relative_to(ROOT)}")
    write_csv(RESULTS / f"serving-{tag}-summary.csv", summary, extra)
    if points:
        title = " ".join(str(extra.get(k, "")) for k in ("shape", "dtype", "device"))
        plot(points, summary, DOCS / f"serving-{tag}.png", f"{title}: serving-{tag}.csv")


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", choices=SHAPES, help="default: llama-124m, mistral-7b on cuda")
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--tag", help="results file tag (default: the --model's name)")
    parser.add_argument("--quick", action="store_true", help="a ~1 minute smoke run")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--modes", nargs="+", default=[m.value for m in MODES], choices=[m.value for m in MODES]
    )
    parser.add_argument(
        "--schedulers",
        nargs="+",
        default=["batching", "one-at-a-time"],
        choices=["batching", "one-at-a-time"],
    )
    parser.add_argument(
        "--from-csv",
        action="store_true",
        help="no run: rebuild the .md tables and the plot from this device's "
        "CSVs (after merging or editing points by hand)",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["serving", "decode", "steps"],
        choices=["serving", "decode", "steps"],
    )
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--pool-chunks", type=int, default=24)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument(
        "--rate-fractions", type=float, nargs="+", help="rates as fractions of 1 / unloaded TTFT"
    )
    parser.add_argument("--requests", type=int, help="requests per point at most")
    parser.add_argument("--time-limit-s", type=float, help="arrivals per point stop after this")
    parser.add_argument("--drain-s", type=float, help="then wait this long for the answers")
    parser.add_argument("--unloaded-requests", type=int)
    parser.add_argument("--decode-batches", type=int, nargs="+")
    parser.add_argument("--decode-repeats", type=int)
    parser.add_argument("--step-batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--short-context", type=int)
    parser.add_argument("--long-context", type=int)
    args = parser.parse_args()
    if args.device == "cuda" and not cuda and not args.from_csv:
        parser.error("--device cuda but torch sees no GPU")
    on_cuda = args.device == "cuda"
    args.shape = args.shape or ("mistral-7b" if on_cuda else "llama-124m")
    defaults = dict(
        rate_fractions=[0.3, 0.55, 0.8, 1.05],
        requests=100 if on_cuda else 16,
        time_limit_s=30.0 if on_cuda else 50.0,
        drain_s=15.0 if on_cuda else 20.0,
        unloaded_requests=5 if on_cuda else 3,
        decode_batches=[1, 4, 16, 64],
        decode_repeats=10 if on_cuda else 5,
        short_context=1024,
        long_context=8191,
    )
    if args.quick:
        args.chunk_tokens, args.pool_chunks = 64, 8
        defaults.update(
            rate_fractions=[0.5],
            requests=4,
            time_limit_s=4.0,
            drain_s=4.0,
            unloaded_requests=1,
            decode_batches=[1, 4],
            decode_repeats=1,
            short_context=256,
            long_context=1023,
        )
        args.output_tokens = min(args.output_tokens, 8)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    prompt = args.chunks * args.chunk_tokens + args.question_tokens
    args.decode_context = prompt + 64  # about a request's context: prompt, template, output
    args.serving_model_len = 1 << math.ceil(math.log2(prompt + args.output_tokens + 128))
    args.decode_model_len = args.serving_model_len
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    label = args.tag or (Path(args.model.rstrip("/")).name.lower() if args.model else None)
    tag = (f"{label}-" if label else "") + args.device + ("-quick" if args.quick else "")
    if args.from_csv:
        rebuild_from_csv(tag)
        return
    started = time.perf_counter()
    loaded = workload_model(args)
    store = build_store(loaded)
    threads = torch.get_num_threads()
    notes: list[str] = []
    points, summary, decode, steps = [], [], [], []
    if "serving" in args.parts:
        print("serving under Poisson load", flush=True)
        points, summary = serving(loaded, store, args, notes)
    if "decode" in args.parts:
        print("decode throughput", flush=True)
        decode = decode_throughput(loaded, store, args, notes)
    if "steps" in args.parts:
        print("decode step time vs context", flush=True)
        steps = step_time_vs_context(loaded, store, args)
    synchronize(loaded.device)
    elapsed = time.perf_counter() - started
    device_name = (
        torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "CPU"
    )
    header = [
        f"{args.model or f'{args.shape} (random init)'} {args.dtype} on {device_name}, "
        f"torch {torch.__version__}, "
        f"{threads} torch threads; whole run {elapsed / 60:.1f} min.",
        "",
        "```",
        "python bench/serving.py " + shlex.join(sys.argv[1:]),
        "```",
        "",
        *[f"- {n}" for n in notes],
        f"- per point: at most {args.requests} requests and {args.time_limit_s:.0f} s of "
        f"arrivals, then {args.drain_s:.0f} s to drain; unanswered requests are cancelled and "
        f"count in TTFT with the time they had waited (a lower bound).",
        f"- batching: max_num_seqs {args.max_num_seqs}; one-at-a-time: max_num_seqs 1; "
        f"max_waiting {args.max_waiting}; cacheblend r = {args.ratio}.",
    ]
    report = markdown(points, summary, decode, steps, header)
    print()
    print(report)
    RESULTS.mkdir(exist_ok=True)
    extra = {"device": args.device, "shape": label or args.shape, "dtype": args.dtype}
    write_csv(RESULTS / f"serving-{tag}.csv", [point_row(p) for p in points], extra)
    write_csv(RESULTS / f"serving-{tag}-summary.csv", summary, extra)
    write_csv(RESULTS / f"serving-{tag}-decode.csv", decode, extra)
    write_csv(RESULTS / f"serving-{tag}-steps.csv", steps, extra)
    (RESULTS / f"serving-{tag}.md").write_text(report)
    print(f"wrote bench/results/serving-{tag}.md")
    if points:
        plot(
            points,
            summary,
            DOCS / f"serving-{tag}.png",
            f"{label or args.shape} {args.dtype} on {device_name}: "
            f"{args.chunks}x{args.chunk_tokens}-token chunks + {args.question_tokens}-token "
            f"question, {args.output_tokens} out",
        )


if __name__ == "__main__":
    main()
