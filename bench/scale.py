"""Scale-out on loopback: aggregate requests/s and TTFT p50/p99 through one gateway over 1, 2 and
3 engines (each engine pinned to one core, one torch thread) under a fixed closed-loop load, and
the first-request TTFT of a fresh engine with Redis warm and cold. A benchmark, never a test."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.load import ModeStats, one_query, percentile  # noqa: E402
from bench.paths import results_dir  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.service_process import Service  # noqa: E402

QUESTIONS = (
    "What is the job of Goulpu?",
    "Where does the river flow?",
    "What grows in the valley?",
    "Which pass crosses the mountains?",
    "When is the harvest festival held?",
    "What do the fishermen sell at the market?",
)
# One thread per engine: several engines on one core would otherwise fight over it.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
FIELDS = (
    "case",
    "engines",
    "clients",
    "requests",
    "errors",
    "req_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
)


class Stack:
    """The processes of one run, each `ragblend SERVICE` on a free loopback port
    (tests/service_process.py), all stopped at the end."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.services: list[Service] = []

    def start(self, name: str, *args: str, core: int | None = None, env=None) -> str:
        log = self.folder / f"{name}-{len(self.services)}.log"
        self.services.append(Service(name, list(args), log, env=env or {}, core=core).start())
        return self.services[-1].url

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop(timeout_s=20)


def ingest(gateway: str, folder: Path) -> None:
    """The sample documents, each waited on until its precompute is no longer pending."""
    from retriever.extract import extract_text, is_supported

    with httpx.Client(base_url=gateway, timeout=600) as http:
        ids = []
        for path in sorted(p for p in folder.iterdir() if is_supported(p.name)):
            text = extract_text(path.name, path.read_bytes()).text
            response = http.post("/v1/documents", json={"text": text, "id": path.stem})
            response.raise_for_status()
            ids.append(path.stem)
        for doc_id in ids:
            while http.get(f"/v1/documents/{doc_id}").json()["precompute"]["status"] == "pending":
                time.sleep(0.2)


async def closed_loop(gateway: str, clients: int, duration_s: float, args) -> dict:
    """`clients` loops, each sending its next query as soon as the last one ended."""
    stats = ModeStats()
    end = time.monotonic() + duration_s

    async def client(index: int) -> None:
        async with httpx.AsyncClient(base_url=gateway, timeout=120) as http:
            i = index
            while time.monotonic() < end:
                body = {
                    "question": QUESTIONS[i % len(QUESTIONS)],
                    "top_k": args.top_k,
                    "max_tokens": args.max_tokens,
                    "stream": True,
                }
                await one_query(http, body, stats)
                i += clients

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed_s = time.monotonic() - started
    return {
        "requests": len(stats.ttft_s),
        "errors": stats.errors,
        "req_per_s": round(len(stats.ttft_s) / elapsed_s, 3),
        "ttft_p50_s": round(percentile(stats.ttft_s, 50), 3),
        "ttft_p99_s": round(percentile(stats.ttft_s, 99), 3),
    }


def first_request_ttft(stack: Stack, retriever: str, engine_args: list[str], env, args) -> float:
    """A fresh engine (empty local tiers) and a gateway over it; the first query's TTFT."""
    engine = stack.start("engine", *engine_args, core=0, env=env)
    gateway = stack.start("gateway", "--retriever-url", retriever, "--engine-urls", engine)
    body = {"question": QUESTIONS[0], "top_k": args.top_k, "max_tokens": 4, "stream": True}

    stats = ModeStats()

    async def ask() -> None:
        async with httpx.AsyncClient(base_url=gateway, timeout=120) as http:
            await one_query(http, body, stats)

    asyncio.run(ask())
    if not stats.ttft_s:
        raise SystemExit(f"the first query of the fresh engine failed: {dict(stats.error_kinds)}")
    return round(stats.ttft_s[0], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the bundled demo model)")
    parser.add_argument("--documents", help="folder ingested (default: the sample documents)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=20.0, help="load per engine count")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--csv", type=Path, default=results_dir() / "scale-cpu.csv")
    args = parser.parse_args()
    from demo import DOCUMENTS_DIR, MODEL_DIR

    model = args.model or str(MODEL_DIR)
    documents = Path(args.documents) if args.documents else DOCUMENTS_DIR
    cores = sorted(os.sched_getaffinity(0))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ragblend-scale-") as scratch:
        folder = Path(scratch)
        stack = Stack(folder)
        tier = RedisServer(folder / "redis").start() if shutil.which("redis-server") else None
        remote = {"RAGBLEND_ENGINE_REMOTE_URL": tier.url} if tier else {}
        engine_env = {**ONE_THREAD, **remote}
        try:
            retriever = stack.start(
                "retriever", "--data-dir", str(folder / "retriever"), "--tokenizer", model
            )
            engines = [
                stack.start(
                    "engine",
                    "--model",
                    model,
                    "--store-path",
                    str(folder / f"kv-{i}"),
                    core=cores[i % len(cores)],
                    env=engine_env,
                )
                for i in range(3)
            ]
            everyone = stack.start(
                "gateway", "--retriever-url", retriever, "--engine-urls", ",".join(engines)
            )
            ingest(everyone, documents)
            for count in (1, 2, 3):
                gateway = stack.start(
                    "gateway",
                    "--retriever-url",
                    retriever,
                    "--engine-urls",
                    ",".join(engines[:count]),
                )
                asyncio.run(closed_loop(gateway, args.clients, 3.0, args))  # warm-up
                result = asyncio.run(closed_loop(gateway, args.clients, args.duration_s, args))
                rows.append(
                    {"case": "closed loop", "engines": count, "clients": args.clients, **result}
                )
                print(json.dumps(rows[-1]), flush=True)
            shared = httpx.get(f"{engines[0]}/health", timeout=5).json().get("shared_kv") is True
            for case in ("fresh engine, Redis warm", "fresh engine, Redis cold"):
                row = {"case": case, "engines": 1, "clients": 1}
                if shared and tier:
                    if case.endswith("cold"):
                        redis.Redis.from_url(tier.url).flushall()
                    fresh = ["--model", model, "--store-path", str(folder / f"kv-{case[-4:]}")]
                    ttft_s = first_request_ttft(stack, retriever, fresh, engine_env, args)
                    row.update(requests=1, errors=0, ttft_p50_s=ttft_s)
                else:
                    row["req_per_s"] = "not measured: the engines report no shared KV tier"
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            stack.stop()
            if tier:
                tier.stop()
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(table(rows, args, len(cores)))


def table(rows: list[dict], args, cores: int) -> str:
    lines = [
        f"{args.clients} closed-loop clients, {args.duration_s:.0f} s per engine count, top_k "
        f"{args.top_k}, max_tokens {args.max_tokens}; {cores} cores; each engine on one core",
        "",
        "| case | engines | requests | errors | req/s | TTFT p50 (s) | TTFT p99 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [row.get(k, "") for k in FIELDS if k != "clients"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
