"""Load generator for a running ragblend stack: N concurrent clients stream POST /v1/query
with a bounded number of requests and a time limit; prints throughput, TTFT p50/p99 per mode
and errors as a Markdown table. A benchmark, never run as a test."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def one_query(
    http: httpx.AsyncClient, body: dict, stats: ModeStats
) -> None:
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
            body = {"question": question, "mode": mode, "top_k": args.top_k,
                    "max_tokens": args.max_tokens, "stream": True}
            await one_query(http, body, stats[mode])

    timeout = httpx.Timeout(args.time_limit_s, connect=5.0)
    limits = httpx.Limits(max_connections=args.concurrency)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout, limits=limits) as http:
        tasks = [asyncio.create_task(client(http)) for _ in range(args.concurrency)]
        # The limit is hard: requests still running at the deadline are cancelled, uncounted.
        _, pending = await asyncio.wait(tasks, timeout=args.time_limit_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return stats, time.perf_counter() - started


def table(stats: dict[str, ModeStats], elapsed_s: float, args: argparse.Namespace) -> str:
    lines = [
        f"{args.concurrency} clients, {args.requests} requests max, {args.time_limit_s:.0f} s "
        f"limit, top_k {args.top_k}, max_tokens {args.max_tokens}; ran {elapsed_s:.1f} s",
        "",
        "| mode | ok | errors | req/s | tokens/s | TTFT p50 (s) | TTFT p99 (s) | latency p50 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    total_ok = total_errors = 0
    for mode, s in stats.items():
        ok = len(s.latency_s)
        total_ok += ok
        total_errors += s.errors
        lines.append(
            f"| {mode} | {ok} | {s.errors} | {ok / elapsed_s:.2f} | "
            f"{s.completion_tokens / elapsed_s:.1f} | {percentile(s.ttft_s, 50):.3f} | "
            f"{percentile(s.ttft_s, 99):.3f} | {percentile(s.latency_s, 50):.3f} |"
        )
    lines.append(f"| all | {total_ok} | {total_errors} | {total_ok / elapsed_s:.2f} | | | | |")
    kinds = {k: v for s in stats.values() for k, v in s.error_kinds.items()}
    if kinds:
        lines += ["", "errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=40, help="requests at most, all modes")
    parser.add_argument("--time-limit-s", type=float, default=120.0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    stats, elapsed_s = asyncio.run(run(args))
    print(table(stats, elapsed_s, args))


if __name__ == "__main__":
    main()
