"""Retrieval quality on the demo's held-out questions: recall@k per question kind for dense, BM25
and hybrid retrieval with one or two hops, and end-to-end exact match of the demo model over
what was retrieved (full prefill and cacheblend).

    .venv/bin/python research/retrieval_quality.py --questions 150 --threads 2    # ~5 min
    .venv/bin/python research/retrieval_quality.py --top-k 2 3 4    # docs/retriever.md, ~10 min
    .venv/bin/python research/retrieval_quality.py --corpus shared --top-k 1 2 3    # ~25 min

Questions' documents (a passage, or a passage with the pronoun passage that follows it, as in
research/quality.py) go into one in-process retriever (RetrieverService, all-MiniLM-L6-v2, flat
index, 512-token chunks: one chunk per document); each question gets its top-k chunks in each
retrieval mode and hop count. recall@k: every gold passage is in a retrieved chunk. EM:
demo.evaluate.answer over the retrieved chunks, in score order ("score": the best first, the
second hop after the first) and reversed ("best_last": the best chunk next to the question, as
the gateway's `chunk_order: best_last` lays them out). Setting "gold" is the reference without
retrieval: the question's own passages, as research/quality.py asks them.

--corpus collections (the default): the questions come in collections of --collection-size
(demo.corpus.held_out_collections) whose documents share no name, one retriever collection
each, and a question searches its own collection: every fact has one value, as in a real
knowledge base. --corpus shared: every question's documents in one collection. The demo draws
its names from a pool of 400, so there different questions' documents state contradicting facts
about one name ("The city of Pukrir? It is Tobra." in one, "... It is Worgas." in another): no
retriever can answer those. A question is "contradicted" when any fact its answer rests on
(both hops of a multi-hop question) has two values in the documents it searches; EM is also
reported over the other questions ("clean"). Writes bench/results/retrieval_quality-CORPUS.csv
(recall) and -CORPUS_em.csv (EM) and prints the tables.
"""

from __future__ import annotations

import argparse
import csv
import logging
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.paths import results_dir, shown  # noqa: E402
from demo import MODEL_DIR  # noqa: E402
from demo.corpus import KINDS, Example, held_out, held_out_collections  # noqa: E402
from demo.evaluate import Config, answer  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.types import Mode  # noqa: E402
from research.quality import documents  # noqa: E402
from retriever.fusion import RETRIEVAL_MODES  # noqa: E402

log = logging.getLogger("bench.retrieval_quality")

# Reported only, never used to choose anything (the validation seed is 1_000_003).
TEST_SEED = 2_000_003
CONFIGS = (Config(Mode.FULL_PREFILL), Config(Mode.CACHEBLEND, 0.15))
ORDERS = ("score", "best_last")
# clean_recall: over the questions no contradiction touches (see contradicted()).
RECALL_FIELDS = [
    "corpus",
    "retrieval",
    "hops",
    "top_k",
    "kind",
    "questions",
    "recall",
    "chunks",
    "search_ms",
    "clean_recall",
]
EM_FIELDS = [
    "corpus",
    "retrieval",
    "hops",
    "top_k",
    "order",
    "mode",
    "kind",
    "questions",
    "exact_match",
    "clean_questions",
    "clean_exact_match",
]
# The demo's fact templates (demo/corpus.py): stated by name, and by pronoun about the subject
# of the passage before.
_NAMED_FACT = re.compile(r"The (\w+) of (\w+)\? It is (\w+)\.")
_PRONOUN_FACT = re.compile(r"(?:Their|Its) (\w+)\? It is (\w+)\.")
_MULTI_QUESTION = re.compile(r"What is the (\w+) of the city of (\w+)\?")
_QUESTION = re.compile(r"What is the (\w+) of (\w+)\?")


@dataclass(frozen=True)
class Setting:
    retrieval: str
    hops: int
    top_k: int


def corpus_facts(texts: Iterable[str]) -> dict[tuple[str, str], set[str]]:
    """(relation, subject) -> every value the documents state for it."""
    facts: dict[tuple[str, str], set[str]] = defaultdict(set)
    for text in texts:
        subject = None
        for passage in text.split("\n\n"):
            named = _NAMED_FACT.findall(passage)
            for relation, name, value in named:
                facts[(relation, name)].add(value)
            if named:
                subject = named[0][1]
            for relation, value in _PRONOUN_FACT.findall(passage):
                if subject is not None:
                    facts[(relation, subject)].add(value)
    return facts


def contradicted(example: Example, facts: dict[tuple[str, str], set[str]]) -> bool:
    """Whether a fact the answer rests on has two values in the corpus."""
    multi = _MULTI_QUESTION.match(example.question)
    if multi:
        relation, person = multi.groups()
        cities = facts[("city", person)]
        return len(cities) > 1 or any(len(facts[(relation, c)]) > 1 for c in cities)
    asked = _QUESTION.match(example.question)
    assert asked, example.question
    return len(facts[asked.groups()]) > 1


# The reference without retrieval: each question's own passages.
GOLD = Setting("gold", 0, 0)


def question_sets(corpus: str, count: int, seed: int, size: int) -> list[list[Example]]:
    """The held-out questions, grouped by the collection whose documents they search."""
    if corpus == "shared":
        return [held_out(count, seed)]
    return held_out_collections(count, seed, size)


def clean_questions(groups: list[list[Example]]) -> list[bool]:
    """Per question (groups flattened): no fact its answer rests on has two values in the
    documents it searches."""
    clean = []
    for group in groups:
        facts = corpus_facts({doc for e in group for doc in documents(e)})
        clean += [not contradicted(e, facts) for e in group]
    return clean


def retrieve(
    groups: list[list[Example]], settings: list[Setting]
) -> tuple[dict[Setting, list[list[str]]], dict[Setting, float]]:
    """Each setting's retrieved chunk texts per question (groups flattened; first hop first),
    and the mean milliseconds of one of its searches (one at a time, in process). Each group's
    documents go into a collection of their own, which its questions search."""
    from retriever.service import DocumentInput, RetrieverService
    from retriever.settings import RetrieverSettings

    contexts: dict[Setting, list[list[str]]] = {}
    search_ms: dict[Setting, float] = {}
    # One group: the default collection, searched without a filter.
    names = [f"c{i}" for i in range(len(groups))] if len(groups) > 1 else ["default"]
    asked = [(e, name) for group, name in zip(groups, names, strict=True) for e in group]
    with tempfile.TemporaryDirectory() as data_dir:
        service = RetrieverService.open(
            RetrieverSettings(data_dir=Path(data_dir), index_save_interval_s=3600.0)
        )
        try:
            texts = sorted(
                (name, doc)
                for group, name in zip(groups, names, strict=True)
                for doc in {d for e in group for d in documents(e)}
            )
            for name, text in tqdm(texts, desc="ingest", unit="doc"):
                service.ingest(DocumentInput(text, collection=name))
            for setting in tqdm(settings, desc="search", unit="setting"):
                started = time.perf_counter()
                contexts[setting] = [
                    [
                        hit.text
                        for hit in service.search(
                            e.question,
                            setting.top_k,
                            retrieval=setting.retrieval,
                            hops=setting.hops,
                            collections=None if len(groups) == 1 else [name],
                        )
                    ]
                    for e, name in asked
                ]
                elapsed_s = time.perf_counter() - started
                search_ms[setting] = 1000 * elapsed_s / len(asked)
        finally:
            service.close()
    return contexts, search_ms


def found_all(example: Example, chunks: list[str]) -> bool:
    return all(any(example.passages[g] in chunk for chunk in chunks) for g in example.gold)


def recall_rows(
    corpus: str,
    examples: list[Example],
    contexts: dict[Setting, list[list[str]]],
    search_ms: dict[Setting, float],
    clean: list[bool],
) -> list[dict]:
    rows = []
    for setting, chunks in contexts.items():
        for kind in [*KINDS, "all"]:
            picked = [
                (e, c) for e, c in zip(examples, chunks, strict=True) if kind in (e.kind, "all")
            ]
            clean_found = [
                found_all(e, c)
                for e, c, ok in zip(examples, chunks, clean, strict=True)
                if ok and kind in (e.kind, "all")
            ]
            rows.append(
                {
                    "corpus": corpus,
                    "retrieval": setting.retrieval,
                    "hops": setting.hops,
                    "top_k": setting.top_k,
                    "kind": kind,
                    "questions": len(picked),
                    "recall": round(statistics.fmean(found_all(e, c) for e, c in picked), 4),
                    "chunks": round(statistics.fmean(len(c) for _, c in picked), 2),
                    "search_ms": round(search_ms[setting], 1),
                    "clean_recall": round(statistics.fmean(clean_found), 4) if clean_found else "",
                }
            )
    return rows


def em_rows(
    corpus: str,
    engine: Engine,
    examples: list[Example],
    chunks: list[list[str]],
    setting: Setting,
    order: str,
    clean: list[bool],
) -> list[dict]:
    """EM of every config over one setting's chunks, per kind, over all and clean questions."""
    scores: dict[str, list[float]] = defaultdict(list)  # config label -> per question
    for example, context in zip(examples, chunks, strict=True):
        passages = context[::-1] if order == "best_last" else context
        outcomes = answer(
            engine, example.question, example.answer, passages, CONFIGS, measure_deviation=False
        )
        for outcome in outcomes:
            scores[outcome.config.label].append(outcome.exact_match)
    rows = []
    for config in CONFIGS:
        for kind in [*KINDS, "all"]:
            picked = [
                (score, ok)
                for e, ok, score in zip(examples, clean, scores[config.label], strict=True)
                if kind in (e.kind, "all")
            ]
            clean_scores = [score for score, ok in picked if ok]
            rows.append(
                {
                    "corpus": corpus,
                    "retrieval": setting.retrieval,
                    "hops": setting.hops,
                    "top_k": setting.top_k,
                    "order": order,
                    "mode": config.label,
                    "kind": kind,
                    "questions": len(picked),
                    "exact_match": round(statistics.fmean(score for score, _ in picked), 4),
                    "clean_questions": len(clean_scores),
                    "clean_exact_match": (
                        round(statistics.fmean(clean_scores), 4) if clean_scores else ""
                    ),
                }
            )
    return rows


def recall_table(rows: list[dict]) -> str:
    lines = [
        "| retrieval | hops | top_k | chunks | " + " | ".join(KINDS) + " | all | ms/search |",
        "|---|---|---|---|" + "---|" * (len(KINDS) + 2),
    ]
    by: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by[(r["retrieval"], r["hops"], r["top_k"])][r["kind"]] = r
    for (retrieval, hops, top_k), kinds in by.items():
        cells = " | ".join(f"{kinds[k]['recall']:.2f}" for k in [*KINDS, "all"])
        total = kinds["all"]
        lines.append(
            f"| {retrieval} | {hops} | {top_k} | {total['chunks']:g} | {cells} "
            f"| {total['search_ms']:.1f} |"
        )
    return "\n".join(lines)


def em_table(rows: list[dict]) -> str:
    lines = [
        "| retrieval | hops | top_k | order | mode | "
        + " | ".join(KINDS)
        + " | all | all, clean questions |",
        "|---|---|---|---|---|" + "---|" * (len(KINDS) + 2),
    ]
    by: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by[(r["retrieval"], r["hops"], r["top_k"], r["order"], r["mode"])][r["kind"]] = r
    for key, kinds in by.items():
        cells = " | ".join(f"{kinds[k]['exact_match']:.3f}" for k in [*KINDS, "all"])
        total = kinds["all"]
        lines.append(
            "| " + " | ".join(str(k) for k in key) + f" | {cells} | "
            f"{total['clean_exact_match']:.3f} ({total['clean_questions']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--seed", type=int, default=TEST_SEED, help="held-out seed")
    parser.add_argument("--corpus", choices=("collections", "shared"), default="collections")
    parser.add_argument("--collection-size", type=int, default=20, help="questions per collection")
    parser.add_argument("--top-k", type=int, nargs="+", default=[3])
    parser.add_argument("--retrieval", nargs="+", choices=RETRIEVAL_MODES, default=RETRIEVAL_MODES)
    parser.add_argument("--hops", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    parser.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    parser.add_argument("--no-em", action="store_true", help="recall only (no demo model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--csv", type=Path, help="default: results/retrieval_quality-CORPUS.csv")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    args.csv = args.csv or results_dir() / f"retrieval_quality-{args.corpus}.csv"

    groups = question_sets(args.corpus, args.questions, args.seed, args.collection_size)
    examples = [e for group in groups for e in group]
    clean = clean_questions(groups)
    for kind in KINDS:
        of_kind = [ok for e, ok in zip(examples, clean, strict=True) if e.kind == kind]
        log.info("%s: %d of %d questions uncontradicted", kind, sum(of_kind), len(of_kind))
    settings = [
        Setting(r, h, k) for r in args.retrieval for h in sorted(args.hops) for k in args.top_k
    ]
    contexts, search_ms = retrieve(groups, settings)
    recall = recall_rows(args.corpus, examples, contexts, search_ms, clean)
    ems: list[dict] = []
    if not args.no_em:
        engine = Engine.from_pretrained(args.model, device="cpu", dtype="float32")
        try:
            gold = [list(e.passages) for e in examples]
            ems += em_rows(args.corpus, engine, examples, gold, GOLD, "score", clean)
            runs = [(s, o) for s in settings for o in args.orders]
            for setting, order in tqdm(runs, desc="answer", unit="setting"):
                ems += em_rows(
                    args.corpus, engine, examples, contexts[setting], setting, order, clean
                )
        finally:
            # As in research/quality.py: a KV write-back still running on the worker thread when
            # the interpreter exits aborts the process.
            engine.close()

    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RECALL_FIELDS)
        writer.writeheader()
        writer.writerows(recall)
    if ems:
        with args.csv.with_name(args.csv.stem + "_em.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=EM_FIELDS)
            writer.writeheader()
            writer.writerows(ems)
    print(
        f"\n{args.questions} held-out questions, seed {args.seed}, corpus {args.corpus} "
        f"({len(groups)} collection(s)); "
        f"{sum(clean)} uncontradicted (see the module docstring)\n"
    )
    print(recall_table(recall))
    if ems:
        print()
        print(em_table(ems))
    print(f"\nwrote {shown(args.csv)}" + (" and its _em.csv" if ems else ""))


if __name__ == "__main__":
    main()
