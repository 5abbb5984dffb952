"""RSS of a real retriever process over rounds of concurrent large ingests and long searches,
with glibc's malloc arenas capped (the default) and uncapped; prints a Markdown table.

    .venv/bin/python research/retriever_memory.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "harbour",
    "granary",
    "ledger",
    "barley",
    "mill",
    "ferry",
    "tower",
    "rain",
    "station",
    "survey",
    "oak",
    "pier",
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = f"{rng.choice(WORDS)}{rng.randrange(100_000)}"
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def start(data_dir: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ragblend", "retriever", "--port", str(port)]
        + ["--data-dir", str(data_dir), "--chunk-tokens", "256"],
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError("retriever did not start")


def run(label: str, env: dict[str, str], rounds: int, port: int) -> list[str]:
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc = start(Path(tmp), port, env)
        url = f"http://127.0.0.1:{port}"
        try:
            rows.append(f"| {label} | start | {rss_mb(proc.pid):.0f} |")
            with httpx.Client(base_url=url, timeout=600) as http, ThreadPoolExecutor(8) as pool:
                for r in range(rounds):
                    docs = [text(rng, 100_000) for _ in range(3)]
                    queries = [text(rng, 50_000) for _ in range(24)]
                    jobs = [pool.submit(http.post, "/v1/documents", json={"text": d}) for d in docs]
                    jobs += [
                        pool.submit(http.post, "/v1/search", json={"query": q, "top_k": 10})
                        for q in queries
                    ]
                    assert all(j.result().status_code == 200 for j in jobs)
                    rows.append(f"| {label} | after round {r + 1} | {rss_mb(proc.pid):.0f} |")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    rows = ["| malloc arenas | when | RSS (MB) |", "|---|---|---:|"]
    rows += run("capped (2, default)", {}, args.rounds, 18_731)
    rows += run("uncapped (MALLOC_ARENA_MAX=64)", {"MALLOC_ARENA_MAX": "64"}, args.rounds, 18_732)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
