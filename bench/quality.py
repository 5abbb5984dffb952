"""Quality of blending on the demo model: exact match, F1 and KV deviation from full prefill for
every mode and recompute ratio, per question kind, with retrieval off and on.

    .venv/bin/python bench/quality.py --threads 2     # 300 held-out questions, ~3 min
    .venv/bin/python bench/quality.py --questions 60 --no-retrieval

Retrieval off: each question's gold passages and distractors, one chunk per passage, in the
generator's fixed order. Retrieval on: every question's documents (a passage, or a passage and
the pronoun passage that follows it: one document each) go into one in-process retriever
(retriever.service.RetrieverService, all-MiniLM-L6-v2, flat index); each question gets its
top-k chunks in score order. Writes bench/results/quality.csv, docs/quality_vs_ratio.png and
docs/ttft_vs_quality.png, and prints the table; bench/results/quality_binding.csv splits the
single-hop questions by how many passages state the asked relation (see binding()).
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from demo import MODEL_DIR  # noqa: E402
from demo.corpus import (  # noqa: E402
    KINDS,
    Example,
    held_out,
    is_pronoun_passage,
    named_rivals,
)
from demo.evaluate import Config, EvalResult, answer  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.types import Mode  # noqa: E402

log = logging.getLogger("bench.quality")

RATIOS = (0.05, 0.1, 0.15, 0.3, 0.5)
CONFIGS = (
    Config(Mode.FULL_PREFILL),
    Config(Mode.PREFIX_CACHE),
    Config(Mode.FULL_REUSE),
    *(Config(Mode.CACHEBLEND, r) for r in RATIOS),
)
FIELDS = [
    "retrieval",
    "mode",
    "recompute_ratio",
    "kind",
    "questions",
    "exact_match",
    "f1",
    "agreement",
    "gold_logprob",
    "kv_deviation",
    "ttft_ms",
]


def documents(example: Example) -> list[str]:
    """The example's passages grouped as documents: a pronoun passage joins the one before."""
    docs: list[list[str]] = []
    for passage in example.passages:
        if docs and is_pronoun_passage(passage):
            docs[-1].append(passage)
        else:
            docs.append([passage])
    return ["\n\n".join(d) for d in docs]


def retrieved_passages(examples: list[Example], top_k: int) -> list[list[str]]:
    """Each question's top-k chunks from one retriever holding every question's documents."""
    from retriever.service import DocumentInput, RetrieverService
    from retriever.settings import RetrieverSettings

    with tempfile.TemporaryDirectory() as data_dir:
        service = RetrieverService.open(
            RetrieverSettings(data_dir=Path(data_dir), index_save_interval_s=3600.0)
        )
        try:
            texts = sorted({doc for e in examples for doc in documents(e)})
            started = time.perf_counter()
            for text in texts:
                service.ingest(DocumentInput(text))
            log.info("ingested %d documents in %.1f s", len(texts), time.perf_counter() - started)
            contexts = [[hit.text for hit in service.search(e.question, top_k)] for e in examples]
        finally:
            service.close()
    recall: dict[str, list[bool]] = defaultdict(list)
    for example, context in zip(examples, contexts, strict=True):
        found = all(any(example.passages[g] in chunk for chunk in context) for g in example.gold)
        recall[example.kind].append(found)
    log.info(
        "retrieval recall@%d (all gold passages retrieved): %s",
        top_k,
        {k: round(statistics.fmean(v), 3) for k, v in recall.items()},
    )
    return contexts


def run(engine: Engine, examples: list[Example], contexts: list[list[str]], setting: str):
    """Per-question outcomes of every config."""
    records: list[tuple[str, Example, EvalResult, bool]] = []
    started = time.perf_counter()
    for i, (example, passages) in enumerate(zip(examples, contexts, strict=True)):
        outcomes = answer(engine, example.question, example.answer, passages, CONFIGS)
        assert outcomes[0].config.mode is Mode.FULL_PREFILL
        for outcome in outcomes:
            # Agreement: the same answer as full prefill, right or wrong.
            records.append(
                (setting, example, outcome, outcome.prediction == outcomes[0].prediction)
            )
        if (i + 1) % 50 == 0:
            log.info(
                "%s: %d/%d questions, %.0f s",
                setting,
                i + 1,
                len(examples),
                time.perf_counter() - started,
            )
    return records


def summarize(records) -> list[dict]:
    groups: dict[tuple, list[EvalResult]] = defaultdict(list)
    agree: dict[tuple, list[bool]] = defaultdict(list)
    for setting, example, outcome, same in records:
        for kind in (example.kind, "all"):
            groups[(setting, outcome.config, kind)].append(outcome)
            agree[(setting, outcome.config, kind)].append(same)
    rows = []
    for (setting, config, kind), outcomes in groups.items():
        rows.append(
            {
                "retrieval": setting,
                "mode": config.mode.value,
                "recompute_ratio": "" if config.recompute_ratio is None else config.recompute_ratio,
                "kind": kind,
                "questions": len(outcomes),
                "exact_match": round(statistics.fmean(o.exact_match for o in outcomes), 4),
                "f1": round(statistics.fmean(o.f1 for o in outcomes), 4),
                "agreement": round(statistics.fmean(agree[(setting, config, kind)]), 4),
                "gold_logprob": round(statistics.fmean(o.gold_logprob for o in outcomes), 4),
                "kv_deviation": round(statistics.fmean(o.kv_deviation for o in outcomes), 4),
                "ttft_ms": round(1000 * statistics.median(o.ttft_s for o in outcomes), 2),
            }
        )
    return rows


def binding(records) -> list[dict]:
    """Full-prefill exact match of single-hop questions (retrieval off) by how many passages state
    the asked relation by name: what the model adds over picking one of them at random."""
    hits: dict[int, list[float]] = defaultdict(list)
    for setting, example, outcome, _ in records:
        full = outcome.config.mode is Mode.FULL_PREFILL
        if setting == "off" and example.kind == "single" and full:
            hits[named_rivals(example)].append(outcome.exact_match)
    return [
        {
            "named_passages_with_relation": n,
            "questions": len(h),
            "exact_match": round(statistics.fmean(h), 4),
            "chance": round(1 / n, 4),
        }
        for n, h in sorted(hits.items())
    ]


def label(row: dict) -> str:
    if row["mode"] == Mode.CACHEBLEND.value:
        return f"cacheblend r={row['recompute_ratio']:g}"
    return row["mode"]


def markdown_table(rows: list[dict], setting: str) -> str:
    """Rows: modes; columns: EM / F1 per kind, then KV deviation and TTFT over all kinds."""
    kinds = [*KINDS, "all"]
    header = (
        "| mode | "
        + " | ".join(f"{k} EM / F1" for k in kinds)
        + " | agree w/ full | gold log p | KV deviation | TTFT ms (median) |"
    )
    lines = [header, "|" + "---|" * (len(kinds) + 5)]
    by = {(label(r), r["kind"]): r for r in rows if r["retrieval"] == setting}
    for config in CONFIGS:
        name = label({"mode": config.mode.value, "recompute_ratio": config.recompute_ratio})
        if (name, "all") not in by:
            continue
        cells = [
            f"{by[(name, k)]['exact_match']:.3f} / {by[(name, k)]['f1']:.3f}"
            for k in kinds
            if (name, k) in by
        ]
        total = by[(name, "all")]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {total['agreement']:.3f} | {total['gold_logprob']:.2f}"
            + f" | {total['kv_deviation']:.4f} | {total['ttft_ms']:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], docs_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in ("off", "on") if any(r["retrieval"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for kind, color in zip([*KINDS, "all"], ["C0", "C1", "C2", "k"], strict=True):
            pick = {label(r): r for r in rows if r["retrieval"] == setting and r["kind"] == kind}
            xs = [0.0, *RATIOS, 1.0]
            ys = [
                pick["full_reuse"]["exact_match"],
                *(pick[f"cacheblend r={r:g}"]["exact_match"] for r in RATIOS),
                pick["full_prefill"]["exact_match"],
            ]
            ax.plot(xs, ys, "o-", color=color, label=kind, lw=2 if kind == "all" else 1.2)
        ax.set_xlabel("recompute ratio r (0 = full reuse, 1 = full prefill)")
        ax.set_ylabel("exact match")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"retrieval {setting}")
        ax.grid(alpha=0.3)
        ax.legend(title="question kind")
    fig.suptitle("Demo model: quality vs. recompute ratio (cacheblend)")
    fig.tight_layout()
    fig.savefig(docs_dir / "quality_vs_ratio.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for setting, marker in (("off", "o"), ("on", "s")):
        pick = [r for r in rows if r["retrieval"] == setting and r["kind"] == "all"]
        for r in pick:
            ax.scatter(
                r["ttft_ms"],
                r["f1"],
                marker=marker,
                color="C3" if r["mode"] != "cacheblend" else "C0",
            )
            ax.annotate(
                label(r),
                (r["ttft_ms"], r["f1"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xlabel("median TTFT (ms, CPU, tiny model; o: retrieval off, s: on)")
    ax.set_ylabel("F1")
    ax.set_title("Demo model: TTFT vs. quality")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(docs_dir / "ttft_vs_quality.png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1_000_003, help="held-out seed")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--no-retrieval", action="store_true", help="skip retrieval on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--csv", type=Path, default=ROOT / "bench/results/quality.csv")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)

    engine = Engine.from_pretrained(args.model, device="cpu", dtype="float32")
    examples = held_out(args.questions, args.seed)
    records = run(engine, examples, [list(e.passages) for e in examples], "off")
    if not args.no_retrieval:
        contexts = retrieved_passages(examples, args.top_k)
        records += run(engine, examples, contexts, "on")
    rows = summarize(records)

    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    bound = binding(records)
    with args.csv.with_name(args.csv.stem + "_binding.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(bound[0]))
        writer.writeheader()
        writer.writerows(bound)
    args.docs.mkdir(parents=True, exist_ok=True)
    plot(rows, args.docs)
    for setting in [s for s in ("off", "on") if any(r["retrieval"] == s for r in rows)]:
        print(f"\nretrieval {setting} ({args.questions} questions)\n")
        print(markdown_table(rows, setting))
    print("\nsingle-hop, full prefill, retrieval off, by passages stating the asked relation\n")
    print("| passages | questions | exact match | chance (1/n) |\n|---|---|---|---|")
    for row in bound:
        print(
            f"| {row['named_passages_with_relation']} | {row['questions']} "
            f"| {row['exact_match']:.3f} | {row['chance']:.3f} |"
        )
    print(
        f"\nwrote {args.csv}, {args.docs / 'quality_vs_ratio.png'}, "
        f"{args.docs / 'ttft_vs_quality.png'}"
    )


if __name__ == "__main__":
    main()
