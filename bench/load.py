"""Load generator for a running ragblend stack: N concurrent clients stream POST /v1/query
(closed loop), or with `--rate` requests arrive as a Poisson process whatever is in flight
(open loop: past capacity the queue grows), with a bounded number of requests and a time
limit; prints throughput (requests and tokens per second), TTFT p50/p99 per mode, errors by
HTTP status and the requests still unanswered at the limit as a Markdown table, and with
`--csv` appends one row per mode (and one for all) to a CSV. A benchmark, never run as a
test."""

from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import json
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODES = ("cacheblend", "full_prefill", "prefix_cache", "full_reuse")
QUESTIONS = (
    "Where does the river flow?",
    "What grows in the valley?",
    "Which pass crosses the mountains?",
    "When is the harvest festival held?",
    "Who keeps the lighthouse?",
    "What do the fishermen sell at the market?",
)


@dataclass
class ModeStats:
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    unfinished: int = 0  # still unanswered at the time limit, cancelled there


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def one_query(http: httpx.AsyncClient, body: dict, stats: ModeStats) -> None:
    """Streams one query; TTFT is the first `delta` event as this client sees it."""
    start = time.perf_counter()
    ttft_s = None
    try:
        async with http.stream("POST", "/v1/query", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                stats.errors += 1
                stats.error_kinds[f"HTTP {response.status_code}"] += 1
                return
            event = None
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "delta" and ttft_s is None:
                    ttft_s = time.perf_counter() - start
                elif line.startswith("data: ") and event == "result":
                    stats.completion_tokens += json.loads(line[6:])["usage"]["completion_tokens"]
                elif line.startswith("data: ") and event == "error":
                    stats.errors += 1
                    stats.error_kinds["stream error"] += 1
                    return
    except httpx.HTTPError as exc:
        stats.errors += 1
        stats.error_kinds[type(exc).__name__] += 1
        return
    except asyncio.CancelledError:
        stats.unfinished += 1
        raise
    stats.latency_s.append(time.perf_counter() - start)
    if ttft_s is not None:
        stats.ttft_s.append(ttft_s)


async def run(args: argparse.Namespace) -> tuple[dict[str, ModeStats], float]:
    stats = {mode: ModeStats() for mode in args.modes}
    # Requests interleave modes and questions, so every mode sees the same mix and load.
    plan = itertools.islice(
        zip(itertools.cycle(args.modes), itertools.cycle(QUESTIONS), strict=False),
        args.requests,
    )
    deadline = time.perf_counter() + args.time_limit_s
    lock = asyncio.Lock()

    async def client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            async with lock:
                item = next(plan, None)
            if item is None:
                return
            mode, question = item
            await one_query(http, request_body(args, mode, question), stats[mode])

    async def arrivals(http: httpx.AsyncClient) -> None:
        """Open loop: each request at its Poisson arrival time, whatever is in flight."""
        rng, at, queries = random.Random(args.seed), 0.0, []
        try:
            for mode, question in plan:
                at += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
                body = request_body(args, mode, question)
                queries.append(asyncio.create_task(one_query(http, body, stats[mode])))
            await asyncio.gather(*queries)
        finally:  # at the time limit: the queries in flight are cancelled, counted unfinished
            for query in queries:
                query.cancel()
            await asyncio.gather(*queries, return_exceptions=True)

    timeout = httpx.Timeout(args.time_limit_s, connect=5.0)
    connections = args.requests if args.rate else args.concurrency
    limits = httpx.Limits(max_connections=connections)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout, limits=limits) as http:
        if args.rate:
            tasks = [asyncio.create_task(arrivals(http))]
        else:
            tasks = [asyncio.create_task(client(http)) for _ in range(args.concurrency)]
        # The limit is hard: requests still running at the deadline are cancelled and counted
        # as unfinished.
        _, pending = await asyncio.wait(tasks, timeout=args.time_limit_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return stats, time.perf_counter() - started


def request_body(args: argparse.Namespace, mode: str, question: str) -> dict:
    return {
        "question": question,
        "mode": mode,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "stream": True,
    }


def combined(stats: dict[str, ModeStats]) -> ModeStats:
    total = ModeStats()
    for s in stats.values():
        total.ttft_s += s.ttft_s
        total.latency_s += s.latency_s
        total.completion_tokens += s.completion_tokens
        total.errors += s.errors
        total.unfinished += s.unfinished
        for kind, count in s.error_kinds.items():
            total.error_kinds[kind] += count
    return total


def rows(stats: dict[str, ModeStats], elapsed_s: float) -> list[dict]:
    """One row per mode and one for all modes; an `errors <kind>` column per error kind seen
    (`HTTP 429`, `HTTP 503`, `stream error`, an httpx exception's name)."""
    kinds = sorted({k for s in stats.values() for k in s.error_kinds})
    out = []
    for mode, s in [*stats.items(), ("all", combined(stats))]:
        ok = len(s.latency_s)
        out.append(
            {
                "mode": mode,
                "ok": ok,
                "errors": s.errors,
                **{f"errors {kind}": s.error_kinds.get(kind, 0) for kind in kinds},
                "unfinished": s.unfinished,
                "req_per_s": ok / elapsed_s,
                "tokens_per_s": s.completion_tokens / elapsed_s,
                "ttft_p50_s": percentile(s.ttft_s, 50),
                "ttft_p99_s": percentile(s.ttft_s, 99),
                "latency_p50_s": percentile(s.latency_s, 50),
            }
        )
    return out


def table(stats: dict[str, ModeStats], elapsed_s: float, args: argparse.Namespace) -> str:
    data = rows(stats, elapsed_s)
    kinds = [k for k in data[0] if k.startswith("errors ")]
    lines = [
        f"{args.label + ': ' if args.label else ''}{load_text(args)}, {args.requests} "
        f"requests max, {args.time_limit_s:.0f} s limit, top_k {args.top_k}, max_tokens "
        f"{args.max_tokens}; ran {elapsed_s:.1f} s",
        "",
        "| mode | ok | errors | "
        + "".join(f"{k[7:]} | " for k in kinds)
        + "unfinished | req/s | tokens/s | TTFT p50 (s) | TTFT p99 (s) | latency p50 (s) |",
        "|---|---:|---:|" + "---:|" * len(kinds) + "---:|---:|---:|---:|---:|---:|",
    ]
    for r in data:
        lines.append(
            f"| {r['mode']} | {r['ok']} | {r['errors']} | "
            + "".join(f"{r[k]} | " for k in kinds)
            + f"{r['unfinished']} | {r['req_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['latency_p50_s']:.3f} |"
        )
    return "\n".join(lines)


def load_text(args: argparse.Namespace) -> str:
    if args.rate:
        return f"Poisson arrivals at {args.rate:g} req/s (seed {args.seed})"
    return f"{args.concurrency} clients"


CSV_FIELDS = [
    "label",
    "concurrency",
    "rate",
    "requests",
    "time_limit_s",
    "elapsed_s",
    "mode",
    "ok",
    "errors",
    "errors_by_status",
    "unfinished",
    "req_per_s",
    "tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "latency_p50_s",
]


def append_csv(path: Path, stats: dict[str, ModeStats], elapsed_s: float, args) -> None:
    """Append this run's rows; error kinds go into one `kind=count;...` column so runs with
    different errors share a header."""
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != CSV_FIELDS:
            columns = ",".join(header)
            raise SystemExit(f"{path}: written with other columns ({columns}); name a new CSV")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        for r in rows(stats, elapsed_s):
            kinds = {k[7:]: v for k, v in r.items() if k.startswith("errors ") and v}
            writer.writerow(
                {
                    "label": args.label,
                    "concurrency": "" if args.rate else args.concurrency,
                    "rate": args.rate or "",
                    "requests": args.requests,
                    "time_limit_s": args.time_limit_s,
                    "elapsed_s": round(elapsed_s, 2),
                    "errors_by_status": ";".join(f"{k}={v}" for k, v in sorted(kinds.items())),
                    **{k: r[k] for k in CSV_FIELDS if k in r},
                }
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open loop instead: Poisson arrivals at this many requests per second",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the --rate arrivals")
    parser.add_argument("--requests", type=int, default=40, help="requests at most, all modes")
    parser.add_argument("--time-limit-s", type=float, default=120.0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--label", default="", help="names this run in the table and CSV")
    parser.add_argument("--csv", type=Path, help="append this run's rows to this CSV")
    args = parser.parse_args()
    if args.rate is not None and args.rate <= 0:
        parser.error(f"--rate must be above 0, got {args.rate}")
    stats, elapsed_s = asyncio.run(run(args))
    print(table(stats, elapsed_s, args))
    if args.csv:
        append_csv(args.csv, stats, elapsed_s, args)


if __name__ == "__main__":
    main()
