"""Quality of blending on the demo model: exact match, F1, KV deviation and teacher-forced KL from
full prefill for every mode and recompute ratio, per question kind, with retrieval off and on.

    .venv/bin/python research/quality.py --threads 2     # 300 held-out test questions, ~4 min
    .venv/bin/python research/quality.py --questions 60 --no-retrieval

Held-out questions come in two splits of the corpus generator (demo/corpus.py): `--split
validation` (seed 1000003) is for choosing runs, `--split test` (seed 2000003, the default) is
only reported; every CSV row names its split and seed. Only the test split writes the plots.

Retrieval off: each question's gold passages and distractors, one chunk per passage, in the
generator's fixed order. Retrieval on: every question's documents (a passage, or a passage and
the pronoun passage that follows it: one document each) go into one in-process retriever
(retriever.service.RetrieverService, all-MiniLM-L6-v2, flat index); each question gets its
top-k chunks in score order. Writes bench/results/quality.csv, docs/quality_vs_ratio.png and
docs/ttft_vs_quality.png, and prints the table; bench/results/quality_binding.csv splits the
single-hop questions by how many passages state the asked relation (see binding()).

    .venv/bin/python research/quality.py --kv-encodings none fp8_e4m3 int8    # ~1 min

instead compares compressed chunk KV (docs/kvstore.md, "Compressed KV"): retrieval off, every
chunk's stored KV round-tripped through each encoding exactly as the SSD tier stores and reads
it, cacheblend at --encoding-ratio (0.15); EM, F1 and KV deviation from full prefill and from the
unquantized store. Writes bench/results/quality_kv_encoding.csv.

    .venv/bin/python research/quality.py --baselines                          # ~10 min

instead asks what the selection adds (retrieval off): cacheblend with HKVD and with a seeded
random pick of the same budget (engine.selection.Selection), at every ratio, with check layer
0, 1, 2 and 3, against full prefill and full reuse. Writes bench/results/quality_baselines.csv
and docs/quality_baselines.png.
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
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.paths import plots_dir, results_dir, shown  # noqa: E402
from demo import MODEL_DIR  # noqa: E402
from demo.corpus import (  # noqa: E402
    KINDS,
    TEST_SEED,
    VALIDATION_SEED,
    Example,
    held_out,
    is_pronoun_passage,
    named_rivals,
)
from demo.evaluate import (  # noqa: E402
    Config,
    EvalResult,
    answer,
    as_chunks,
    exact_match,
    f1_score,
)
from engine.blend.selection import Selection  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.types import GenerateRequest, Mode  # noqa: E402
from evaluation.deviation import kv_deviation  # noqa: E402
from kvstore import codec, tiers  # noqa: E402

log = logging.getLogger("bench.quality")

SEEDS = {"validation": VALIDATION_SEED, "test": TEST_SEED}
RATIOS = (0.01, 0.05, 0.1, 0.15, 0.3, 0.5)
CONFIGS = (
    Config(Mode.FULL_PREFILL),
    Config(Mode.PREFIX_CACHE),
    Config(Mode.FULL_REUSE),
    *(Config(Mode.CACHEBLEND, r) for r in RATIOS),
)
# The demo model has 4 layers: a check at layer 3 leaves one layer to the selection. At layer 0
# the K/V depend on the token alone, so HKVD sees no deviation there to select by.
BASELINE_CHECK_LAYERS = (0, 1, 2, 3)
# CacheBlend's selection against the random pick; every selection is compared on real text by
# bench/quality_real.py (the demo's with --model).
BASELINE_SELECTIONS = (Selection.HKVD, Selection.RANDOM)
BASELINE_REFERENCES = (Config(Mode.FULL_PREFILL), Config(Mode.FULL_REUSE))
BLEND_CONFIGS = tuple(Config(Mode.CACHEBLEND, r) for r in RATIOS)
METRIC_FIELDS = [
    "kind",
    "questions",
    "exact_match",
    "f1",
    "agreement",
    "gold_logprob",
    "kv_deviation",
    "tf_kl",
    "tf_argmax_agreement",
    "ttft_ms",
]
FIELDS = ["split", "seed", "retrieval", "mode", "recompute_ratio", *METRIC_FIELDS]
BASELINE_FIELDS = [
    "split",
    "seed",
    "check_layer",
    "selection",
    "mode",
    "recompute_ratio",
    *METRIC_FIELDS,
]
# A record: the row's own columns (retrieval, or check layer and selection), the question, one
# config's outcome, and whether its answer is full prefill's.
Record = tuple[dict[str, object], Example, EvalResult, bool]


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


def run(
    engine: Engine, examples: list[Example], contexts: list[list[str]], setting: str
) -> list[Record]:
    """Per-question outcomes of every config."""
    records: list[Record] = []
    pairs = zip(examples, contexts, strict=True)
    for example, passages in tqdm(pairs, total=len(examples), desc=f"retrieval {setting}"):
        outcomes = answer(engine, example.question, example.answer, passages, CONFIGS)
        assert outcomes[0].config.mode is Mode.FULL_PREFILL
        for outcome in outcomes:
            # Agreement: the same answer as full prefill, right or wrong.
            same = outcome.prediction == outcomes[0].prediction
            records.append(({"retrieval": setting}, example, outcome, same))
    return records


def run_baselines(engine: Engine, examples: list[Example]) -> list[Record]:
    """Cacheblend with each selection and check layer at every ratio, retrieval off.

    The variants share the model and the KV store of `engine`, so each chunk is precomputed
    once; full prefill and full reuse (no selection, no check layer) are answered once.
    """
    variants = {
        (layer, selection): Engine(
            engine.loaded,
            engine.store,
            check_layers=(layer,),
            selection=selection,
            max_num_seqs=1,
        )
        for layer in BASELINE_CHECK_LAYERS
        for selection in BASELINE_SELECTIONS
    }
    records: list[Record] = []
    try:
        for example in tqdm(examples, desc="baselines"):
            question, gold, passages = example.question, example.answer, example.passages
            references = answer(engine, question, gold, passages, BASELINE_REFERENCES)
            full = references[0].prediction
            for outcome in references:
                columns: dict[str, object] = {"check_layer": "", "selection": ""}
                records.append((columns, example, outcome, outcome.prediction == full))
            for (layer, selection), variant in variants.items():
                for outcome in answer(variant, question, gold, passages, BLEND_CONFIGS):
                    columns = {"check_layer": layer, "selection": selection.value}
                    records.append((columns, example, outcome, outcome.prediction == full))
    finally:
        for variant in variants.values():
            variant.close()
    return records


def summarize(records: list[Record], split: str) -> list[dict]:
    groups: dict[tuple, list[EvalResult]] = defaultdict(list)
    agree: dict[tuple, list[bool]] = defaultdict(list)
    for columns, example, outcome, same in records:
        for kind in (example.kind, "all"):
            key = (tuple(columns.items()), outcome.config, kind)
            groups[key].append(outcome)
            agree[key].append(same)
    rows = []
    for (columns, config, kind), outcomes in groups.items():
        rows.append(
            {
                "split": split,
                "seed": SEEDS[split],
                **dict(columns),
                "mode": config.mode.value,
                "recompute_ratio": "" if config.recompute_ratio is None else config.recompute_ratio,
                "kind": kind,
                "questions": len(outcomes),
                "exact_match": round(statistics.fmean(o.exact_match for o in outcomes), 4),
                "f1": round(statistics.fmean(o.f1 for o in outcomes), 4),
                "agreement": round(statistics.fmean(agree[(columns, config, kind)]), 4),
                "gold_logprob": round(statistics.fmean(o.gold_logprob for o in outcomes), 4),
                "kv_deviation": round(statistics.fmean(o.kv_deviation for o in outcomes), 4),
                "tf_kl": round(statistics.fmean(o.tf_kl for o in outcomes), 6),
                "tf_argmax_agreement": round(
                    statistics.fmean(o.tf_argmax_agreement for o in outcomes), 4
                ),
                "ttft_ms": round(1000 * statistics.median(o.ttft_s for o in outcomes), 2),
            }
        )
    return rows


def binding(records: list[Record]) -> list[dict]:
    """Full-prefill exact match of single-hop questions (retrieval off) by how many passages state
    the asked relation by name: what the model adds over picking one of them at random."""
    hits: dict[int, list[float]] = defaultdict(list)
    for columns, example, outcome, _ in records:
        full = outcome.config.mode is Mode.FULL_PREFILL
        if columns["retrieval"] == "off" and example.kind == "single" and full:
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


ENCODING_FIELDS = [
    "split",
    "seed",
    "encoding",
    "bytes_per_value",
    "recompute_ratio",
    "questions",
    "exact_match",
    "f1",
    "agreement_with_none",
    "kv_deviation",
    "kv_deviation_vs_none",
    "chunk_kv_error",
]


def encoding_quality(
    engine: Engine, examples: list[Example], encodings: list[str], ratio: float
) -> list[dict]:
    """Cacheblend at `ratio` with each question's chunk KV stored in each encoding.

    Per question: the chunks' KV is precomputed, then for each encoding the store's entries are
    replaced by what an SSD tier in that encoding gives back (codec.round_trip: the same
    quantize and dequantize as the tier's write and read) and the question answered. KV
    deviation is measured from full prefill (as in the main table) and from the blended KV of
    the unquantized store ("none"); chunk_kv_error is the relative error ‖x̂ − x‖² / ‖x‖² of
    the stored KV itself. The original entries are put back after each question.
    """
    memory = engine.store.tier(tiers.MEMORY)
    outcomes: dict[str, list[dict]] = defaultdict(list)
    started = time.perf_counter()
    for i, example in enumerate(examples):
        chunks = as_chunks(example.passages)
        engine.precompute(chunks)
        keys = [engine.chunk_key(*c) for c in engine.chunks.tokens(chunks)]
        originals = {key: memory.get(key) for key in keys}
        assert all(kv is not None for kv in originals.values()), "memory budget too small"
        full = GenerateRequest(question=example.question, chunks=chunks, mode=Mode.FULL_PREFILL)
        full_prefill = engine.prefill(full)
        reference, spans = full_prefill.output, full_prefill.layout.chunk_spans
        request = GenerateRequest(
            question=example.question,
            chunks=chunks,
            mode=Mode.CACHEBLEND,
            recompute_ratio=ratio,
            max_tokens=12,
            temperature=0.0,
        )
        unquantized = None
        for encoding in ["none", *(e for e in encodings if e != "none")]:
            error_num = error_den = 0.0
            for key, kv in originals.items():
                assert kv is not None
                stored = codec.round_trip(kv, encoding)
                memory.put(key, stored)
                for x, y in ((stored.keys, kv.keys), (stored.values, kv.values)):
                    error_num += float((x.float() - y.float()).pow(2).sum())
                    error_den += float(y.float().pow(2).sum())
            blended = engine.prefill(request).output
            text = engine.generate(request).text.strip()
            if unquantized is None:
                unquantized = (blended, text)
            outcomes[encoding].append(
                {
                    "exact_match": exact_match(text, example.answer),
                    "f1": f1_score(text, example.answer),
                    "agreement_with_none": float(text == unquantized[1]),
                    "kv_deviation": kv_deviation(
                        blended.keys, blended.values, reference.keys, reference.values, spans
                    ),
                    "kv_deviation_vs_none": kv_deviation(
                        blended.keys,
                        blended.values,
                        unquantized[0].keys,
                        unquantized[0].values,
                        spans,
                    ),
                    "chunk_kv_error": error_num / error_den,
                }
            )
        for key, kv in originals.items():
            assert kv is not None
            memory.put(key, kv)
        if (i + 1) % 50 == 0:
            log.info("%d/%d questions, %.0f s", i + 1, len(examples), time.perf_counter() - started)
    value_bytes = engine.loaded.dtype.itemsize
    rows = []
    for encoding in [e for e in codec.ENCODINGS if e in outcomes]:
        results = outcomes[encoding]
        row: dict = {
            "encoding": encoding,
            "bytes_per_value": value_bytes if encoding == "none" else 1,
            "recompute_ratio": ratio,
            "questions": len(results),
        }
        for field in ENCODING_FIELDS[6:]:
            mean = statistics.fmean(r[field] for r in results)
            row[field] = round(mean, 4 if field in ("exact_match", "f1") else 6)
        rows.append(row)
    return rows


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
        + " | agree w/ full | gold log p | KV deviation | TF KL | TF argmax agree"
        + " | TTFT ms (median) |"
    )
    lines = [header, "|" + "---|" * (len(kinds) + 7)]
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
            + f" | {total['kv_deviation']:.4f} | {total['tf_kl']:.4f}"
            + f" | {total['tf_argmax_agreement']:.3f} | {total['ttft_ms']:.1f} |"
        )
    return "\n".join(lines)


def baseline_table(rows: list[dict]) -> str:
    """Rows: check layer and ratio; columns: HKVD against random on the context questions and
    over all kinds."""
    by = {
        (r["check_layer"], r["selection"], r["recompute_ratio"], r["kind"]): r
        for r in rows
        if r["mode"] == Mode.CACHEBLEND.value
    }
    lines = [
        "| check layer | r | context EM hkvd / random | all EM hkvd / random "
        "| agree w/ full hkvd / random | gold log p hkvd / random | KV deviation hkvd / random "
        "| TF KL hkvd / random |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layer in BASELINE_CHECK_LAYERS:
        for ratio in RATIOS:
            hk, rc = (by[(layer, s.value, ratio, "context")] for s in BASELINE_SELECTIONS)
            ha, ra = (by[(layer, s.value, ratio, "all")] for s in BASELINE_SELECTIONS)
            lines.append(
                f"| {layer} | {ratio:g} | {hk['exact_match']:.3f} / {rc['exact_match']:.3f} "
                f"| {ha['exact_match']:.3f} / {ra['exact_match']:.3f} "
                f"| {ha['agreement']:.3f} / {ra['agreement']:.3f} "
                f"| {ha['gold_logprob']:.2f} / {ra['gold_logprob']:.2f} "
                f"| {ha['kv_deviation']:.4f} / {ra['kv_deviation']:.4f} "
                f"| {ha['tf_kl']:.4f} / {ra['tf_kl']:.4f} |"
            )
    for mode in (Mode.FULL_PREFILL, Mode.FULL_REUSE):
        context, total = (
            next(r for r in rows if r["mode"] == mode.value and r["kind"] == kind)
            for kind in ("context", "all")
        )
        lines.append(
            f"| {mode.value} | | {context['exact_match']:.3f} | {total['exact_match']:.3f} "
            f"| {total['agreement']:.3f} | {total['gold_logprob']:.2f} "
            f"| {total['kv_deviation']:.4f} | {total['tf_kl']:.4f} |"
        )
    return "\n".join(lines)


def plot_baselines(rows: list[dict], path: Path) -> None:
    """Per check layer: context-question EM and KV deviation against r, HKVD and random."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = {(r["mode"], r["kind"]): r for r in rows if r["mode"] != Mode.CACHEBLEND.value}
    fig, axes = plt.subplots(
        2, len(BASELINE_CHECK_LAYERS), figsize=(4.3 * len(BASELINE_CHECK_LAYERS), 6.5), sharey="row"
    )
    for column, layer in enumerate(BASELINE_CHECK_LAYERS):
        em_ax, kv_ax = axes[0][column], axes[1][column]
        for selection, style in zip(BASELINE_SELECTIONS, ("o-", "s--"), strict=True):
            pick = {
                (r["recompute_ratio"], r["kind"]): r
                for r in rows
                if r["check_layer"] == layer and r["selection"] == selection.value
            }
            em_ax.plot(
                RATIOS,
                [pick[(ratio, "context")]["exact_match"] for ratio in RATIOS],
                style,
                label=f"{selection.value}: context",
            )
            kv_ax.plot(
                RATIOS,
                [pick[(ratio, "all")]["kv_deviation"] for ratio in RATIOS],
                style,
                label=selection.value,
            )
        for mode, color in ((Mode.FULL_PREFILL, "k"), (Mode.FULL_REUSE, "C3")):
            em_ax.axhline(
                reference[(mode.value, "context")]["exact_match"],
                color=color,
                ls=":",
                label=f"{mode.value}: context",
            )
        kv_ax.axhline(
            reference[(Mode.FULL_REUSE.value, "all")]["kv_deviation"],
            color="C3",
            ls=":",
            label="full_reuse",
        )
        em_ax.set_title(f"check layer {layer}")
        for ax in (em_ax, kv_ax):
            ax.set_xscale("log")
            ax.set_xlabel("recompute ratio r")
            ax.grid(alpha=0.3)
        em_ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("exact match, context questions")
    axes[1][0].set_ylabel("KV deviation from full prefill")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle("Demo model: HKVD against a random pick of the same budget (retrieval off)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict], docs_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in ("off", "on") if any(r["retrieval"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for kind, color in zip([*KINDS, "all"], ["C0", "C1", "C2", "k"], strict=True):
            pick = {label(r): r for r in rows if r["retrieval"] == setting and r["kind"] == kind}
            if not pick:  # fewer --questions than kinds: this kind was not drawn
                continue
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
    parser.add_argument(
        "--split",
        choices=sorted(SEEDS),
        default="test",
        help="held-out questions: validation (for choosing runs) or test (reported)",
    )
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--no-retrieval", action="store_true", help="skip retrieval on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--csv",
        type=Path,
        help="default bench/results/quality.csv (test) or quality_validation.csv (validation)",
    )
    parser.add_argument("--docs", type=Path, default=plots_dir())
    parser.add_argument(
        "--kv-encodings",
        nargs="+",
        choices=codec.ENCODINGS,
        help="compare chunk KV stored in these encodings instead (retrieval off)",
    )
    parser.add_argument("--encoding-ratio", type=float, default=0.15)
    parser.add_argument(
        "--baselines",
        action="store_true",
        help="compare HKVD with a random selection at check layers 0-3 instead (retrieval off)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.csv is None:
        name = "quality.csv" if args.split == "test" else f"quality_{args.split}.csv"
        args.csv = results_dir() / name
    # Plots show headline figures, which come from the test split only.
    plots = args.split == "test"

    engine = Engine.from_pretrained(args.model, device="cpu", dtype="float32")
    examples = held_out(args.questions, SEEDS[args.split])
    try:
        if args.kv_encodings:
            encoding_main(engine, examples, args)
        elif args.baselines:
            baselines_main(engine, examples, args, plots)
        else:
            sweep_main(engine, examples, args, plots)
    finally:
        # The worker thread may still be writing back chunk KV: a daemon thread inside torch
        # when the interpreter exits aborts the process (SIGABRT) after every file was written.
        engine.close()


def sweep_main(
    engine: Engine, examples: list[Example], args: argparse.Namespace, plots: bool
) -> None:
    records = run(engine, examples, [list(e.passages) for e in examples], "off")
    if not args.no_retrieval:
        contexts = retrieved_passages(examples, args.top_k)
        records += run(engine, examples, contexts, "on")
    rows = summarize(records, args.split)

    write_csv(args.csv, FIELDS, rows)
    split_columns = {"split": args.split, "seed": SEEDS[args.split]}
    bound = [{**split_columns, **row} for row in binding(records)]
    write_csv(args.csv.with_name(args.csv.stem + "_binding.csv"), list(bound[0]), bound)
    if plots:
        args.docs.mkdir(parents=True, exist_ok=True)
        plot(rows, args.docs)
    title = f"{args.split} split, seed {SEEDS[args.split]}, {args.questions} questions"
    for setting in [s for s in ("off", "on") if any(r["retrieval"] == s for r in rows)]:
        print(f"\nretrieval {setting} ({title})\n")
        print(markdown_table(rows, setting))
    print("\nsingle-hop, full prefill, retrieval off, by passages stating the asked relation\n")
    print("| passages | questions | exact match | chance (1/n) |\n|---|---|---|---|")
    for row in bound:
        print(
            f"| {row['named_passages_with_relation']} | {row['questions']} "
            f"| {row['exact_match']:.3f} | {row['chance']:.3f} |"
        )
    written = [args.csv]
    if plots:
        written += [args.docs / "quality_vs_ratio.png", args.docs / "ttft_vs_quality.png"]
    print(f"\nwrote {', '.join(map(shown, written))}")


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def baselines_main(
    engine: Engine, examples: list[Example], args: argparse.Namespace, plots: bool
) -> None:
    started = time.perf_counter()
    rows = summarize(run_baselines(engine, examples), args.split)
    seconds = time.perf_counter() - started
    path = args.csv.with_name(args.csv.stem + "_baselines.csv")
    write_csv(path, BASELINE_FIELDS, rows)
    written = [path]
    if plots:
        args.docs.mkdir(parents=True, exist_ok=True)
        written.append(args.docs / "quality_baselines.png")
        plot_baselines(rows, written[-1])
    print(
        f"\nHKVD against random selection, retrieval off, {args.split} split (seed "
        f"{SEEDS[args.split]}), {len(examples)} questions ({seconds:.0f} s)\n"
    )
    print(baseline_table(rows))
    print(f"\nwrote {', '.join(map(shown, written))}")


def encoding_main(engine: Engine, examples: list[Example], args: argparse.Namespace) -> None:
    started = time.perf_counter()
    rows = [
        {"split": args.split, "seed": SEEDS[args.split], **row}
        for row in encoding_quality(engine, examples, args.kv_encodings, args.encoding_ratio)
    ]
    seconds = time.perf_counter() - started
    path = args.csv.with_name(args.csv.stem + "_kv_encoding.csv")
    write_csv(path, ENCODING_FIELDS, rows)
    print(
        f"\ncacheblend r = {args.encoding_ratio:g}, {len(examples)} held-out questions "
        f"({args.split} split, seed {SEEDS[args.split]}), retrieval off, chunk KV stored in each "
        f"encoding ({seconds:.0f} s)\n"
    )
    print(
        "| encoding | bytes/value | EM | F1 | agree w/ none | KV deviation | KV deviation vs none "
        "| chunk KV error |\n|---|---|---|---|---|---|---|---|"
    )
    for row in rows:
        print(
            f"| {row['encoding']} | {row['bytes_per_value']} | {row['exact_match']:.3f} "
            f"| {row['f1']:.3f} | {row['agreement_with_none']:.3f} | {row['kv_deviation']:.4f} "
            f"| {row['kv_deviation_vs_none']:.6f} | {row['chunk_kv_error']:.2e} |"
        )
    print(f"\nwrote {shown(path)}")


if __name__ == "__main__":
    main()
