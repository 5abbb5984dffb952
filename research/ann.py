"""ANN benchmark (not a test): flat, HNSW, IVF-Flat and IVF-PQ at 100k and 1M vectors: build
time, memory, recall@5 against flat and one-query latency p50/p99; writes bench/results/ann.csv."""

# What is measured how:
# - vectors: 384-dim, made from real MiniLM embeddings (embedding 1M texts on 2 cores is out of
#   reach) by bench.retriever_bench.synthetic: a random mix of two real embeddings plus
#   Gaussian noise, renormalised. Two distributions:
#   * template: the retriever bench's own (paragraphs of one generated template, noise 0.04).
#     The noise (norm 0.04 * sqrt(384) = 0.78) drowns the signal: neighbours are nearly
#     equidistant, much harder than real embeddings (see the data rows of the CSV);
#   * sentences: sentences of the standard library's docstrings (diverse English), noise
#     0.01; queries are mixes of held-out sentences.
#   Each distribution gets a data row: median cosine of the 1st / 5th neighbour and of a
#   random vector, relative contrast (mean distance / nearest distance) and local intrinsic
#   dimensionality (MLE over 20 neighbours); real MiniLM sentence embeddings are the reference.
# - every index is a retriever.index.VectorIndex filled 10,000 vectors at a time, as the
#   service fills it (so IVF trains when it reaches its threshold, as in production);
#   build time includes training; memory is the size of the serialised index (the index file)
#   and the growth of the process RSS during the build; search is one query at a time, k=5,
#   through VectorIndex.search; recall@5 is against the exact flat answer.
# - faiss uses `--threads` OpenMP threads for everything (builds; a one-query search uses one).
#
# Run: .venv/bin/python research/ann.py --dist template sentences --sizes 100000 1000000

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import inspect
import itertools
import logging
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import _on_path  # noqa: E402, F401  (bench/ on sys.path)
import faiss
import numpy as np
import psutil
from paths import results_dir
from retriever_bench import WORDS, corpus, synthetic

from retriever.index import IndexParams, VectorIndex

DIM = 384
NOISE = {"template": 0.04, "sentences": 0.01}
FIELDS = [
    "dist",
    "vectors",
    "index",
    "build",
    "search",
    "build_s",
    "index_mb",
    "rss_mb",
    "recall_at_5",
    "p50_ms",
    "p99_ms",
    "queries",
    "threads",
]
DATA_FIELDS = ["dist", "vectors", "sim_1", "sim_5", "sim_random", "contrast", "lid"]


def docstring_sentences(limit: int) -> list[str]:
    """Distinct English sentences from the standard library's docstrings, shuffled."""
    skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}
    found: dict[str, None] = {}
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in skip:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # platform-only modules
            continue
        for obj in [module] + [getattr(module, a, None) for a in dir(module) if a[0] != "_"]:
            doc = inspect.getdoc(obj) if obj is not None else None
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join((doc or "").split())):
                if 40 <= len(sentence) <= 300:
                    found[sentence] = None
        if len(found) >= 3 * limit:
            break
    sentences = list(found)
    random.Random(0).shuffle(sentences)
    return sentences[:limit]


def real_embeddings(dist: str, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """(base, query seeds): MiniLM embeddings, cached between runs."""
    path = cache / f"ragblend-ann-{dist}.npz"
    if path.exists():
        saved = np.load(path)
        return saved["base"], saved["queries"]
    from retriever.embeddings import Embedder

    embedder = Embedder(None, "cpu", 32)
    if dist == "template":
        texts = [p for d in corpus(80, 4, seed=1) for p in d.split("\n\n")]
        questions = [
            f"Which {a} of {b.capitalize()}{i} held {i * 37 % 1000} {c}s?"
            for i, (a, b, c) in enumerate(
                zip(WORDS * 4, WORDS[5:] * 4, WORDS[9:] * 4, strict=False)
            )
        ][:100]
    else:
        sentences = docstring_sentences(4000)
        questions, texts = sentences[:500], sentences[500:]
    logging.info("embedding %d + %d %s texts", len(texts), len(questions), dist)
    base, queries = embedder.encode(texts), embedder.encode(questions)
    np.savez(path, base=base, queries=queries)
    return base, queries


def data_row(dist: str, vectors: np.ndarray, queries: np.ndarray) -> dict:
    """How far apart neighbours are: the harder, the closer to 1 the contrast and the larger
    the intrinsic dimensionality."""
    sample = queries[:200]
    flat = faiss.IndexFlatIP(DIM)
    flat.add(vectors)
    sims, _ = flat.search(sample, 20)
    dists = np.sqrt(np.maximum(0.0, 2 - 2 * sims))
    random_sims = sample @ vectors[np.random.default_rng(1).integers(len(vectors), size=2000)].T
    mean_dist = np.sqrt(np.maximum(0.0, 2 - 2 * random_sims)).mean(axis=1)
    lid = -1 / np.mean(np.log(np.maximum(dists, 1e-9) / dists[:, -1:]), axis=1)
    return dict(
        dist=dist,
        vectors=len(vectors),
        sim_1=round(float(np.median(sims[:, 0])), 3),
        sim_5=round(float(np.median(sims[:, 4])), 3),
        sim_random=round(float(np.median(random_sims)), 3),
        contrast=round(float(np.median(mean_dist / np.maximum(dists[:, 0], 1e-9))), 3),
        lid=round(float(np.median(lid)), 1),
    )


def variants(size: int, args: argparse.Namespace) -> list[tuple[IndexParams, list[IndexParams]]]:
    """(build parameters, the search settings tried on that build), for the kinds asked."""
    hnsw = args.hnsw or ([(32, 80)] if args.quick else [(16, 80), (32, 80)])
    nlist = 1024
    out = [(IndexParams("flat", DIM), [IndexParams("flat", DIM)])]
    for m, efc in hnsw:
        built = IndexParams("hnsw", DIM, hnsw_m=m, hnsw_ef_construction=efc)
        efs = args.ef or [128, 256, 512, 1024] + ([2048, 4096] if size > 200_000 else [])
        out.append((built, [dataclasses.replace(built, hnsw_ef_search=e) for e in efs]))
    for kind in ("ivf", "ivfpq"):
        built = IndexParams(kind, DIM, ivf_nlist=nlist, pq_m=48, pq_bits=8)
        probes = [16, 32, 64, 128, 256]
        out.append((built, [dataclasses.replace(built, ivf_nprobe=p) for p in probes]))
    # flat stays: it is the exact answer the others are scored against
    return [v for v in out if v[0].kind == "flat" or v[0].kind in args.kinds]


def describe(params: IndexParams, search: bool) -> str:
    if params.kind == "hnsw":
        return (
            f"efSearch={params.hnsw_ef_search}"
            if search
            else (f"M={params.hnsw_m} efConstruction={params.hnsw_ef_construction}")
        )
    if params.kind in ("ivf", "ivfpq"):
        if search:
            return f"nprobe={params.ivf_nprobe}"
        pq = f" pq_m={params.pq_m} pq_bits={params.pq_bits}" if params.kind == "ivfpq" else ""
        return f"nlist={params.ivf_nlist}{pq}"
    return "-"


def searched(index: VectorIndex, vectors: np.ndarray, query: np.ndarray, rerank: int) -> np.ndarray:
    """The top-5 ids; with `rerank`, the best `rerank` candidates re-scored with their exact
    vectors, as the retriever service re-scores IVF-PQ candidates with stored embeddings."""
    ids = index.search(query[None, :], max(5, rerank))[1][0]
    if not rerank:
        return ids
    ids = ids[ids >= 1]
    exact = vectors[ids - 1] @ query  # ids are 1..N
    return ids[np.argsort(-exact)[:5]]


def run(dist: str, size: int, args: argparse.Namespace, rows: list[dict]) -> dict:
    base, seeds = real_embeddings(dist, args.cache)
    vectors = synthetic(base, size, NOISE[dist], seed=size)
    queries = synthetic(seeds, args.queries, NOISE[dist], seed=7)
    ids = np.arange(1, size + 1, dtype=np.int64)
    stats = data_row(dist, vectors, queries)
    logging.info("%s", stats)
    exact: np.ndarray | None = None
    process = psutil.Process()
    for built, searches in variants(size, args):
        rss = process.memory_info().rss
        index = VectorIndex(built)
        started = time.perf_counter()
        for start in range(0, size, 10_000):
            index.add(ids[start : start + 10_000], vectors[start : start + 10_000])
        build_s = time.perf_counter() - started
        rss_mb = (process.memory_info().rss - rss) / 2**20
        index_mb = len(index.to_bytes(0)) / 2**20
        if exact is None:
            exact = index.search(queries, 5)[1]  # flat, exact: batched, not timed
        reranks = [0, *args.pq_rerank] if built.kind == "ivfpq" else [0]
        for search, rerank in itertools.product(searches, reranks):
            index.params = search
            # flat at 1M costs ~0.1-0.2 s a query: fewer queries time it well enough
            count = min(len(queries), args.flat_queries) if built.kind == "flat" else len(queries)
            latencies, found = [], []
            for query in queries[:count]:
                t0 = time.perf_counter()
                found.append(searched(index, vectors, query, rerank))
                latencies.append(time.perf_counter() - t0)
            recall = np.mean(
                [len(set(a) & set(b)) / 5 for a, b in zip(found, exact[:count], strict=True)]
            )
            ms = np.asarray(latencies) * 1000
            row = dict(
                dist=dist,
                vectors=size,
                index=built.kind,
                build=describe(built, search=False),
                search=describe(search, search=True) + (f" rerank={rerank}" if rerank else ""),
                build_s=round(build_s, 1),
                index_mb=round(index_mb, 1),
                rss_mb=round(rss_mb, 1),
                recall_at_5=round(float(recall), 3),
                p50_ms=round(float(np.percentile(ms, 50)), 3),
                p99_ms=round(float(np.percentile(ms, 99)), 3),
                queries=count,
                threads=args.threads,
            )
            rows.append(row)
            logging.info("%s", row)
        del index
    return stats


def merge(path: Path, fields: list[str], rows: list[dict], key: list[str]) -> None:
    """Add `rows` to the CSV, replacing the rows measured before with the same `key`."""
    kept: list[dict] = []
    new = {tuple(str(r[k]) for k in key) for r in rows}
    if path.exists():
        with open(path, newline="") as f:
            kept = [r for r in csv.DictReader(f) if tuple(r[k] for k in key) not in new]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(kept + rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", nargs="+", default=["template", "sentences"], choices=NOISE)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--flat-queries", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="faiss OpenMP threads")
    parser.add_argument("--quick", action="store_true", help="one HNSW build instead of two")
    parser.add_argument("--kinds", nargs="+", default=["hnsw", "ivf", "ivfpq"])
    parser.add_argument("--ef", type=int, nargs="+", help="HNSW efSearch values to try")
    parser.add_argument(
        "--hnsw",
        type=lambda text: tuple(int(v) for v in text.split(":")),
        nargs="+",
        metavar="M:EFC",
        help="HNSW builds to try, as M:efConstruction (default 16:80 32:80)",
    )
    parser.add_argument(
        "--pq-rerank",
        type=int,
        nargs="*",
        default=[100],
        help="IVF-PQ candidates re-scored exactly, besides none",
    )
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(message)s")
    for noisy in ("sentence_transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    faiss.omp_set_num_threads(args.threads)
    logging.info(
        "faiss %s, %d threads, load average %s", faiss.__version__, args.threads, os.getloadavg()
    )
    rows: list[dict] = []
    data: list[dict] = []
    for size in args.sizes:
        for dist in args.dist:
            data.append(run(dist, size, args, rows))
    merge(results_dir() / "ann.csv", FIELDS, rows, ["dist", "vectors", "index", "build", "search"])
    merge(results_dir() / "ann_data.csv", DATA_FIELDS, data, ["dist", "vectors"])
    print(
        "| dist | vectors | index | build | search | build s | index MB | recall@5 | p50 ms "
        "| p99 ms |"
    )
    print("|---|---:|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dist']} | {r['vectors']} | {r['index']} | {r['build']} | {r['search']} "
            f"| {r['build_s']} | {r['index_mb']} | {r['recall_at_5']} | {r['p50_ms']} "
            f"| {r['p99_ms']} |"
        )
    logging.info("load average at the end %s", os.getloadavg())


if __name__ == "__main__":
    main()
