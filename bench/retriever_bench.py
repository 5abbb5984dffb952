"""Retriever benchmark (not a test): ingest throughput and search latency p50/p99 at 10k and
100k chunks, flat vs HNSW, in one run; prints a table and writes bench/results/retriever.csv."""

# What is measured how:
# - ingest: the real RetrieverService (chunking, MiniLM embedding, SQLite commit, index add)
#   on a generated corpus of `--ingest-chunks` chunks of `--chunk-tokens` tokens.
# - embed: MiniLM alone on chunks of at most 256 tokens (its window), and one query at a time.
# - index build/search at 10k and 100k: embedding 100k chunks on 2 cores would take over an
#   hour, so those vectors are made from the real chunk embeddings of the ingest step (a random
#   mix of two plus Gaussian noise, sigma `--noise`, renormalised); queries likewise from real
#   query embeddings.
#   Search latency is one query at a time (k=5) through VectorIndex.search, FAISS only;
#   a service search adds the query embedding and one SQLite lookup (reported separately).
#
# Run: .venv/bin/python bench/retriever_bench.py  (about 2 minutes on 2 cores)

from __future__ import annotations

import argparse
import csv
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
from paths import results_dir, shown

from retriever.embeddings import Embedder
from retriever.index import IndexParams, VectorIndex
from retriever.service import DocumentInput, RetrieverService
from retriever.settings import RetrieverSettings

WORDS = [
    "river",
    "harbour",
    "granary",
    "ledger",
    "barley",
    "tower",
    "ferry",
    "lantern",
    "copper",
    "market",
    "council",
    "winter",
    "storm",
    "survey",
    "station",
    "rainfall",
    "bridge",
    "mill",
    "wheat",
    "salt",
    "herring",
    "merchant",
    "charter",
    "captain",
    "chemist",
    "alloy",
    "furnace",
    "archive",
    "treaty",
    "border",
    "valley",
]


def corpus(num_docs: int, paragraphs: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(num_docs):
        paras = []
        for p in range(paragraphs):
            sentences = [
                f"In {1700 + int(rng.integers(300))} the {rng.choice(WORDS)} of "
                f"{rng.choice(WORDS).capitalize()}{d} held {int(rng.integers(1000))} "
                f"{rng.choice(WORDS)}s near the {rng.choice(WORDS)} (entry {d}.{p}.{s})."
                for s in range(6)
            ]
            paras.append(" ".join(sentences))
        docs.append("\n\n".join(paras))
    return docs


def percentiles_ms(samples_s: list[float]) -> tuple[float, float]:
    ms = np.asarray(samples_s) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def latency_row(step: str, chunks: int, call, queries: list[str], index: str = "-") -> dict:
    """p50 / p99 of `call` once per query, the queries three times over, one at a time."""
    latencies = []
    for q in queries * 3:
        t0 = time.perf_counter()
        call(q)
        latencies.append(time.perf_counter() - t0)
    p50, p99 = percentiles_ms(latencies)
    return dict(
        step=step, index=index, chunks=chunks, value=f"{p50:.1f} / {p99:.1f}", unit="ms p50 / p99"
    )


def bench_ingest(args: argparse.Namespace, rows: list[dict]) -> tuple[np.ndarray, Embedder]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = RetrieverSettings(data_dir=Path(tmp), chunk_tokens=args.chunk_tokens)
        service = RetrieverService.open(settings)
        # ~12 tokens per sentence, 6 per paragraph: about 75 tokens per paragraph.
        paragraphs = max(1, args.chunk_tokens // 75)
        docs = corpus(args.ingest_chunks // 4 + 1, paragraphs * 4, seed=1)
        started, chunks = time.perf_counter(), 0
        for text in docs:
            chunks += len(service.ingest(DocumentInput(text=text)).chunk_ids)
            if chunks >= args.ingest_chunks:
                break
        elapsed = time.perf_counter() - started
        rows.append(
            dict(
                step="ingest (service: chunk+embed+SQLite+index)",
                index="flat",
                chunks=chunks,
                value=round(chunks / elapsed, 1),
                unit="chunks/s",
            )
        )
        queries = [
            f"How many {w}s did the {v} of {u.capitalize()}{i} hold?"
            for i, (w, v, u) in enumerate(zip(WORDS, WORDS[3:], WORDS[7:], strict=False))
        ]
        step = "search (service: embed query+FAISS+SQLite)"
        rows.append(latency_row(step, chunks, lambda q: service.search(q, 5), queries, "flat"))
        vectors = np.concatenate(
            [v for _, v in service.catalog.embeddings(None, service.embedder.info.dim)]
        )
        embedder = service.embedder
        service.close()

    short = [t for d in corpus(args.embed_chunks // 5 + 1, 5, seed=2) for t in d.split("\n\n")][
        : args.embed_chunks
    ]
    t0 = time.perf_counter()
    embedder.encode(short)
    rows.append(
        dict(
            step="embed only (MiniLM, <=256-token chunks, batch 32)",
            index="-",
            chunks=len(short),
            value=round(len(short) / (time.perf_counter() - t0), 1),
            unit="chunks/s",
        )
    )
    rows.append(latency_row("embed one query", 1, lambda q: embedder.encode([q]), queries))
    return vectors, embedder


def synthetic(base: np.ndarray, n: int, noise: float, seed: int) -> np.ndarray:
    """n unit vectors near the real ones: a random convex mix of two real embeddings plus
    Gaussian noise. Mixing spreads them over the data's manifold; noise alone would make
    tight balls of near-duplicates whose exact top-k is a coin toss among ties."""
    rng = np.random.default_rng(seed)
    first = base[rng.integers(len(base), size=n)]
    second = base[rng.integers(len(base), size=n)]
    weight = rng.uniform(0.0, 1.0, size=(n, 1))
    out = weight * first + (1 - weight) * second + rng.normal(0, noise, (n, base.shape[1]))
    out = out.astype(np.float32)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def bench_index(args, base: np.ndarray, queries: np.ndarray, rows: list[dict]) -> None:
    dim = base.shape[1]
    for size in args.sizes:
        vectors = synthetic(base, size, args.noise, seed=size)
        ids = np.arange(1, size + 1, dtype=np.int64)
        exact: np.ndarray | None = None
        for kind in ("flat", "hnsw"):
            index = VectorIndex(IndexParams(kind=kind, dim=dim))
            t0 = time.perf_counter()
            for start in range(0, size, 10_000):
                index.add(ids[start : start + 10_000], vectors[start : start + 10_000])
            build_s = time.perf_counter() - t0
            latencies, found = [], []
            for q in queries:
                t1 = time.perf_counter()
                _, hit = index.search(q[None, :], 5)
                latencies.append(time.perf_counter() - t1)
                found.append(hit[0])
            p50, p99 = percentiles_ms(latencies)
            found_arr = np.stack(found)
            if kind == "flat":
                exact = found_arr
            pairs = zip(found_arr, exact, strict=True)
            recall = np.mean([len(set(a) & set(b)) / 5 for a, b in pairs])
            rows.append(
                dict(
                    step="index add",
                    index=kind,
                    chunks=size,
                    value=round(size / build_s),
                    unit="vectors/s",
                )
            )
            rows.append(
                dict(
                    step="index search k=5 (FAISS)",
                    index=kind,
                    chunks=size,
                    value=f"{p50:.2f} / {p99:.2f}",
                    unit="ms p50 / p99",
                )
            )
            rows.append(
                dict(
                    step="recall@5 vs flat",
                    index=kind,
                    chunks=size,
                    value=round(float(recall), 3),
                    unit="fraction",
                )
            )
            logging.info(
                "%s %d: add %.1f s, search p50 %.2f ms p99 %.2f ms, recall %.3f",
                kind,
                size,
                build_s,
                p50,
                p99,
                recall,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--ingest-chunks", type=int, default=300)
    parser.add_argument("--embed-chunks", type=int, default=500)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--noise", type=float, default=0.04)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(message)s")
    for noisy in ("sentence_transformers", "retriever", "faiss", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    started = time.perf_counter()
    rows: list[dict] = []
    base, embedder = bench_ingest(args, rows)
    questions = [
        f"Which {a} of {b.capitalize()}{i} held {i * 37 % 1000} {c}s?"
        for i, (a, b, c) in enumerate(zip(WORDS * 4, WORDS[5:] * 4, WORDS[9:] * 4, strict=False))
    ]
    real_queries = embedder.encode(questions[:100])
    queries = synthetic(real_queries, args.queries, args.noise, seed=7)
    bench_index(args, base, queries, rows)

    out = results_dir() / "retriever.csv"
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "index", "chunks", "value", "unit"])
        writer.writeheader()
        writer.writerows(rows)
    print("| step | index | chunks | value | unit |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['step']} | {r['index']} | {r['chunks']} | {r['value']} | {r['unit']} |")
    print(f"\ntotal run time {time.perf_counter() - started:.0f} s; CSV: {shown(out)}")


if __name__ == "__main__":
    main()
