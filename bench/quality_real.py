"""Quality of blending on a real model (SmolLM2-135M-Instruct by default) over real text: teacher-
forced KL from full prefill and prefill time of every mode, selection, r and check layer set.

    .venv/bin/python bench/quality_real.py --threads 2     # 24 prompts of 4 x 128 tokens
    .venv/bin/python bench/quality_real.py --prompts 8 --ratios 0.15 --check-layers 1 --coverages
    .venv/bin/python bench/quality_real.py --from-csv      # the tables and plot of the last run

Prompts: `evaluation.real_text` (CPython's language reference and Debian's common licenses: they
do not change with the repository), each of --chunks-per-prompt consecutive chunks of one
document cut by the retriever's chunking (--chunk-tokens of the model's tokenizer) and a question
on its first section. Per prompt, full prefill's greedy answer (--answer-tokens) is fed after
each setting's prompt KV and the next-token distributions are compared at every answer position
(evaluation.teacher_forcing). Settings: full_prefill, prefix_cache, full_reuse; cacheblend with
every --selections (the oracles of engine/oracle.py included) at every --ratios on the first
--check-layers set, --deep-selections at every ratio on the next --curves - 1 sets, every serving
selection at --layer-ratios on the other sets, and the auto ratio at each --coverages on the
curve sets. Prefill time is that of the prompt with every chunk's KV in RAM, what its TTFT is
made of.

Writes bench/results/quality_real.csv (one row per setting), bench/results/quality_real-
prompts.csv (one per prompt and setting) and docs/quality_real.png (KL against prefill time
relative to full prefill), and prints the table and each curve against HKVD at r = 0.15.
"""

from __future__ import annotations

import argparse
import csv
import logging
import random
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.paths import plots_dir, results_dir, shown  # noqa: E402
from engine.blend.selection import Selection  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.quality.oracle import Oracle  # noqa: E402
from engine.types import AUTO_RATIO, Mode  # noqa: E402
from evaluation.compare import Case, PromptResult, Variant, compare_prompts  # noqa: E402
from evaluation.real_text import build_prompts  # noqa: E402

log = logging.getLogger("bench.quality_real")

RATIOS = (0.01, 0.05, 0.1, 0.15, 0.3, 0.5)
# Check layer sets: the first CURVES get every ratio. Layer 1; layers 1 and 7 (a quarter of
# SmolLM2's 30 layers: the selections that read the question's attention read it at the last);
# layer 2; gradual filtering over layers 1-3.
CHECK_LAYERS = ("1", "1,7", "2", "1,2,3")
CURVES = 2
DEEP_SELECTIONS = ("hkvd", "weighted", "query_hkvd")
LAYER_RATIOS = (0.15,)
COVERAGES = (0.8, 0.9, 0.95)
VARIANT_MODEL_LEN = 2048
VARIANT_POOL_BYTES = 256 << 20
FIELDS = [
    "setting",
    "mode",
    "selection",
    "check_layer",
    "recompute_ratio",
    "auto_coverage",
    "prompts",
    "prompt_tokens_mean",
    "tf_kl_mean",
    "tf_kl_median",
    "tf_kl_ci95_low",
    "tf_kl_ci95_high",
    "tf_argmax_agreement",
    "kl_below_random",  # share of prompts where the KL is below random's at the same r
    "recomputed_tokens_mean",
    "prefill_ms_median",
    "prefill_vs_full_median",
]
TEXT_FIELDS = {"setting", "mode", "selection", "check_layer"}
BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Setting:
    label: str
    mode: Mode
    selection: str = ""  # a Selection's value, or "oracle-<kind>"
    check_layers: str = ""  # e.g. "1" or "1,2,3"
    recompute_ratio: float | str | None = None
    auto_coverage: float | None = None

    @property
    def oracle(self) -> Oracle | None:
        prefix = "oracle-"
        return Oracle(self.selection[len(prefix) :]) if self.selection.startswith(prefix) else None


def settings_for(
    ratios: list[float],
    check_layers: list[str],
    curves: int,
    layer_ratios: list[float],
    selections: list[str],
    deep_selections: list[str],
    coverages: list[float],
) -> list[Setting]:
    """The baselines; at the first `curves` check layer sets every selection (`deep_selections`
    after the first set, the oracles at the first only) at every ratio and at the auto ratio of
    each coverage; at the other sets every serving selection at `layer_ratios`."""
    settings = [Setting(Mode.PREFIX_CACHE.value, Mode.PREFIX_CACHE)]
    settings.append(Setting(Mode.FULL_REUSE.value, Mode.FULL_REUSE))
    serving = [s for s in selections if not s.startswith("oracle-")]
    for index, layers in enumerate(check_layers):
        if index >= curves:
            chosen, set_ratios = serving, layer_ratios
        else:
            chosen = selections if index == 0 else [s for s in serving if s in deep_selections]
            set_ratios = ratios
        for ratio in set_ratios:
            for selection in chosen:
                label = f"cacheblend@{ratio:g} {selection} L{layers}"
                settings.append(Setting(label, Mode.CACHEBLEND, selection, layers, ratio))
        if index >= curves:
            continue
        for coverage in coverages:
            for selection in chosen:
                if selection.startswith("oracle-") or selection == Selection.RANDOM.value:
                    continue
                label = f"cacheblend@auto{coverage:g} {selection} L{layers}"
                settings.append(
                    Setting(label, Mode.CACHEBLEND, selection, layers, AUTO_RATIO, coverage)
                )
    return settings


def variant_of(setting: Setting, reference: Engine, engines: dict) -> Variant:
    if not setting.check_layers:
        return Variant(setting.label, reference, setting.mode)
    oracle = setting.oracle
    return Variant(
        setting.label,
        engines[setting.check_layers, setting.auto_coverage],
        setting.mode,
        setting.recompute_ratio,
        None if oracle is not None else Selection(setting.selection),
        oracle,
    )


def bootstrap_ci(values: list[float], seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the mean, resampling prompts."""
    rng = random.Random(seed)
    means = sorted(
        statistics.fmean(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_SAMPLES)
    )
    return means[int(0.025 * BOOTSTRAP_SAMPLES)], means[int(0.975 * BOOTSTRAP_SAMPLES) - 1]


def summarize(settings: list[Setting], results: list[PromptResult]) -> list[dict]:
    rows = []
    by_label = results[0].by_label if results else {}
    reference_ms = [1000 * r.reference_prefill_s for r in results]
    full = {
        "setting": Mode.FULL_PREFILL.value,
        "mode": Mode.FULL_PREFILL.value,
        "prompts": len(results),
        "prompt_tokens_mean": round(statistics.fmean(r.prompt_tokens for r in results), 1),
        "tf_kl_mean": 0.0,
        "tf_kl_median": 0.0,
        "tf_kl_ci95_low": 0.0,
        "tf_kl_ci95_high": 0.0,
        "tf_argmax_agreement": 1.0,
        "recomputed_tokens_mean": round(statistics.fmean(r.prompt_tokens for r in results), 1),
        "prefill_ms_median": round(statistics.median(reference_ms), 1),
        "prefill_vs_full_median": 1.0,
    }
    rows.append(full)
    for setting in settings:
        measured = [r.by_label[setting.label] for r in results]
        kls = [m.deviation.kl for m in measured]
        low, high = bootstrap_ci(kls)
        row: dict = {
            "setting": setting.label,
            "mode": setting.mode.value,
            "selection": setting.selection,
            "check_layer": setting.check_layers,
            "recompute_ratio": "" if setting.recompute_ratio is None else setting.recompute_ratio,
            "auto_coverage": "" if setting.auto_coverage is None else setting.auto_coverage,
            "prompts": len(results),
            "prompt_tokens_mean": full["prompt_tokens_mean"],
            "tf_kl_mean": round(statistics.fmean(kls), 6),
            "tf_kl_median": round(statistics.median(kls), 6),
            "tf_kl_ci95_low": round(low, 6),
            "tf_kl_ci95_high": round(high, 6),
            "tf_argmax_agreement": round(
                statistics.fmean(m.deviation.argmax_agreement for m in measured), 4
            ),
            "recomputed_tokens_mean": round(
                statistics.fmean(m.recomputed_tokens for m in measured), 1
            ),
            "prefill_ms_median": round(statistics.median(1000 * m.prefill_s for m in measured), 1),
            "prefill_vs_full_median": round(
                statistics.median(
                    m.prefill_s / r.reference_prefill_s
                    for m, r in zip(measured, results, strict=True)
                ),
                3,
            ),
        }
        rival = setting.label.replace(f" {setting.selection} ", f" {Selection.RANDOM.value} ")
        if setting.selection not in ("", Selection.RANDOM.value) and rival in by_label:
            random_kls = [r.by_label[rival].deviation.kl for r in results]
            below = sum(h < x for h, x in zip(kls, random_kls, strict=True))
            row["kl_below_random"] = round(below / len(kls), 4)
        rows.append(row)
    return rows


# What the selections are measured against: CacheBlend's own choice, HKVD at r = 0.15, layer 1.
REFERENCE_SETTING = "cacheblend@0.15 hkvd L1"


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at x on the polyline through `points` (sorted by x), None outside it."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def equal_ttft_table(rows: list[dict]) -> str:
    """Each curve (a selection at a check layer set, every fixed ratio) against the reference:
    its KL at the reference's prefill time, and its prefill time at the reference's KL, as
    shares of the reference's (below 1: better)."""
    reference = next((r for r in rows if r["setting"] == REFERENCE_SETTING), None)
    if reference is None:
        return ""
    ttft, kl = reference["prefill_vs_full_median"], reference["tf_kl_mean"]
    curves: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row["mode"] == Mode.CACHEBLEND.value and not isinstance(row["recompute_ratio"], str):
            curves.setdefault((row["selection"], row["check_layer"]), []).append(row)
    lines = [
        f"| selection | check layers | KL at {REFERENCE_SETTING}'s prefill time, / its KL "
        f"| prefill time at its KL, / its time |",
        "|---|---|---|---|",
    ]
    for (selection, layers), line in sorted(curves.items()):
        if len(line) < 2:
            continue
        # Prefill time grows with r, KL falls: both are read off the curve through r.
        by_ratio = sorted(line, key=lambda r: r["recompute_ratio"])
        times = sorted((r["prefill_vs_full_median"], r["tf_kl_mean"]) for r in by_ratio)
        kls = sorted((r["tf_kl_mean"], r["prefill_vs_full_median"]) for r in by_ratio)
        at_time, at_kl = interpolate(times, ttft), interpolate(kls, kl)
        lines.append(
            f"| {selection} | {layers} "
            f"| {'' if at_time is None else f'{at_time / kl:.2f}'} "
            f"| {'' if at_kl is None else f'{at_kl / ttft:.2f}'} |"
        )
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| setting | TF KL mean [95 % CI] | median | argmax agree | below random "
        "| recomputed tokens | prefill ms | vs full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        below = r.get("kl_below_random")
        lines.append(
            f"| {r['setting']} | {r['tf_kl_mean']:.4f} [{r['tf_kl_ci95_low']:.4f}, "
            f"{r['tf_kl_ci95_high']:.4f}] | {r['tf_kl_median']:.4f} "
            f"| {r['tf_argmax_agreement']:.3f} | {'' if below is None else f'{below:.2f}'} "
            f"| {r['recomputed_tokens_mean']:.0f} | {r['prefill_ms_median']:.0f} "
            f"| {r['prefill_vs_full_median']:.2f} |"
        )
    return "\n".join(lines)


# One colour per selection (the oracles in greys), one line style per check layer set.
COLORS = {
    "hkvd": "C0",
    "query_hkvd": "C1",
    "sink": "C2",
    "weighted": "C3",
    "query": "C4",
    "sink_hkvd": "C5",
    "random": "C7",
    "oracle-weighted": "k",
    "oracle-deviation": "0.4",
    "oracle-attention": "0.65",
}
STYLES = ("o-", "s--", "^:", "v-.")


def plot(rows: list[dict], path: Path, title: str, check_layers: list[str]) -> None:
    """Teacher-forced KL against prefill time relative to full prefill: one line per selection
    and check layer set through its ratios (auto ratios as crosses), full reuse as a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    lines: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row["mode"] == Mode.CACHEBLEND.value:
            lines.setdefault((row["selection"], row["check_layer"]), []).append(row)
    for (selection, layers), line in sorted(lines.items()):
        ratios = sorted(
            (r for r in line if not isinstance(r["recompute_ratio"], str)),
            key=lambda r: r["recompute_ratio"],
        )
        if len(ratios) < 2:
            continue
        color = COLORS.get(selection, "C9")
        ax.plot(
            [r["prefill_vs_full_median"] for r in ratios],
            [r["tf_kl_mean"] for r in ratios],
            STYLES[check_layers.index(layers) % len(STYLES)] if layers in check_layers else "o-",
            color=color,
            markersize=4,
            label=f"{selection}, check layers {layers}",
        )
        autos = [r for r in line if r["recompute_ratio"] == AUTO_RATIO]
        ax.scatter(
            [r["prefill_vs_full_median"] for r in autos],
            [r["tf_kl_mean"] for r in autos],
            marker="x",
            color=color,
            s=40,
        )
        if layers == check_layers[0] and selection == Selection.HKVD.value:
            for r in ratios:
                ax.annotate(
                    f"r={r['recompute_ratio']:g}",
                    (r["prefill_vs_full_median"], r["tf_kl_mean"]),
                    fontsize=7,
                    xytext=(3, -10),
                    textcoords="offset points",
                )
    reuse = next((r for r in rows if r["mode"] == Mode.FULL_REUSE.value), None)
    if reuse is not None:
        ax.scatter(
            reuse["prefill_vs_full_median"], reuse["tf_kl_mean"], marker="v", s=80, color="k"
        )
        ax.annotate(
            "full reuse",
            (reuse["prefill_vs_full_median"], reuse["tf_kl_mean"]),
            fontsize=8,
            xytext=(6, 0),
            textcoords="offset points",
        )
    ax.set_yscale("log")
    ax.set_xlabel("prefill time (TTFT) relative to full prefill (KL 0 at 1.0), median over prompts")
    ax.set_ylabel("teacher-forced KL(full ‖ setting), nats per answer token")
    ax.set_title(textwrap.fill(title + "; x: the auto ratio", 90), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_per_prompt(results: list[PromptResult], settings: list[Setting], path: Path) -> None:
    """Teacher-forced KL and argmax agreement of every setting on every prompt, in order."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "setting", "tf_kl", "tf_argmax_agreement"])
        for index, result in enumerate(results):
            for setting in settings:
                deviation = result.by_label[setting.label].deviation
                writer.writerow([index, setting.label, deviation.kl, deviation.argmax_agreement])


def positive(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 1000:
        raise argparse.ArgumentTypeError(f"must be in 1..1000, got {number}")
    return number


def ratio(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"a recompute ratio is in (0, 1], got {number}")
    return number


def layers(value: str) -> str:
    try:
        numbers = [int(layer) for layer in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"check layers are comma-separated ints, got {value!r}"
        ) from None
    if any(n < 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"check layers are >= 0, got {value!r}")
    return ",".join(str(n) for n in sorted(set(numbers)))


def default_model() -> str:
    """The packaged SmolLM2, converted once and cached (tests/real_model.py)."""
    from tests.real_model import smollm2_checkpoint

    return str(smollm2_checkpoint())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the packaged SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=positive, default=24)
    parser.add_argument("--chunk-tokens", type=positive, default=128)
    parser.add_argument("--chunks-per-prompt", type=positive, default=4)
    parser.add_argument("--answer-tokens", type=positive, default=16)
    parser.add_argument("--ratios", type=ratio, nargs="+", default=list(RATIOS))
    parser.add_argument(
        "--check-layers",
        type=layers,
        nargs="+",
        default=list(CHECK_LAYERS),
        help="check layer sets, e.g. 1 2 1,2,3 (every ratio at the first, --layer-ratios at "
        "the others)",
    )
    parser.add_argument(
        "--curves",
        type=positive,
        default=CURVES,
        help="how many of the first check layer sets get every ratio",
    )
    parser.add_argument(
        "--deep-selections",
        nargs="+",
        choices=[s.value for s in Selection],
        default=list(DEEP_SELECTIONS),
        help="the selections measured at every ratio on the curve sets after the first",
    )
    parser.add_argument(
        "--selections",
        nargs="+",
        choices=[s.value for s in Selection] + [f"oracle-{o.value}" for o in Oracle],
        default=[s.value for s in Selection] + [f"oracle-{o.value}" for o in Oracle],
    )
    parser.add_argument(
        "--coverages",
        type=ratio,
        nargs="*",
        default=list(COVERAGES),
        help="auto ratio: the shares of the selection's mass covered (none: no auto settings)",
    )
    parser.add_argument("--auto-max-ratio", type=ratio, default=0.5)
    parser.add_argument("--layer-ratios", type=ratio, nargs="+", default=list(LAYER_RATIOS))
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--csv", type=Path, default=results_dir() / "quality_real.csv")
    parser.add_argument("--png", type=Path, default=plots_dir() / "quality_real.png")
    parser.add_argument(
        "--prompts-csv",
        type=Path,
        default=results_dir() / "quality_real-prompts.csv",
        help="one row per prompt and setting",
    )
    parser.add_argument(
        "--from-csv",
        action="store_true",
        help="measure nothing: the tables and the plot of the rows already in --csv",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.from_csv:
        rows = read_rows(args.csv)
        name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
        report(rows, args, title_of(name, int(rows[0]["prompts"]), args))
        return
    torch.set_num_threads(args.threads)
    model = args.model or default_model()

    started = time.perf_counter()
    reference = Engine.from_pretrained(model, dtype=args.dtype, max_num_seqs=1)
    settings = settings_for(
        args.ratios,
        args.check_layers,
        args.curves,
        args.layer_ratios,
        args.selections,
        args.deep_selections,
        args.coverages,
    )
    engines = {
        (s.check_layers, s.auto_coverage): Engine(
            reference.loaded,
            reference.store,
            check_layers=tuple(int(layer) for layer in s.check_layers.split(",")),
            auto_coverage=s.auto_coverage or 0.5,
            auto_max_ratio=args.auto_max_ratio,
            max_num_seqs=1,
            # Prefills here build their KV outside the pool: a small pool per engine.
            max_model_len=min(VARIANT_MODEL_LEN, reference.max_model_len),
            kv_pool_bytes=VARIANT_POOL_BYTES,
        )
        for s in settings
        if s.check_layers
    }
    variants = [variant_of(s, reference, engines) for s in settings]
    prompts = build_prompts(
        reference.tokenizer,
        chunk_tokens=args.chunk_tokens,
        chunks_per_prompt=args.chunks_per_prompt,
        limit=args.prompts,
    )
    if len(prompts) < args.prompts:
        log.warning("only %d prompts of %d chunks exist", len(prompts), args.chunks_per_prompt)
    cases = [Case(p.question, p.passages, variants) for p in prompts]
    results = []
    try:
        compared = compare_prompts(reference, cases, args.answer_tokens)
        for result in tqdm(
            compared, desc=f"{len(settings) + 1} settings", total=len(cases), unit="prompt"
        ):
            results.append(result)
    finally:
        for engine in engines.values():
            engine.close()
        reference.close()
    seconds = time.perf_counter() - started
    rows = summarize(settings, results)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    write_per_prompt(results, settings, args.prompts_csv)
    title = title_of(Path(model).name, len(results), args)
    print(f"\n{title} ({seconds:.0f} s, {args.threads} threads)\n")
    report(rows, args, title)


def title_of(name: str, prompts: int, args: argparse.Namespace) -> str:
    return (
        f"{name}, {args.dtype}: {prompts} real-text prompts of {args.chunks_per_prompt} x "
        f"{args.chunk_tokens}-token chunks, {args.answer_tokens} answer tokens"
    )


def read_rows(path: Path) -> list[dict]:
    """The rows of a CSV this script wrote, numbers as numbers ("auto" stays a string)."""

    def value(field: str, text: str) -> object:
        if field in TEXT_FIELDS:
            return text
        if text == "":
            return None
        try:
            return float(text)
        except ValueError:
            return text

    with path.open(newline="") as f:
        return [{k: value(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def report(rows: list[dict], args: argparse.Namespace, title: str) -> None:
    plot(rows, args.png, title, args.check_layers)
    print(markdown_table(rows))
    print(f"\nagainst {REFERENCE_SETTING} (targets: KL <= 0.5 x at its time, or time <= 0.6 x")
    print("at its KL)\n")
    print(equal_ttft_table(rows))
    print(f"\nwrote {shown(args.csv)}, {shown(args.png)}")


if __name__ == "__main__":
    main()
