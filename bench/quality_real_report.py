"""The rows, tables and plot of bench/quality_real.py: each setting's KL and prefill time summed
over the prompts, written to and read back from its CSVs (`--from-csv`), each curve against HKVD.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from bench.paths import shown
from engine.blend.selection import Selection
from engine.types import AUTO_RATIO, Mode
from evaluation.compare import PromptResult

if TYPE_CHECKING:
    from bench.quality_real import Setting

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


def write_per_prompt(results: list[PromptResult], settings: list[Setting], path: Path) -> None:
    """Teacher-forced KL and argmax agreement of every setting on every prompt, in order."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "setting", "tf_kl", "tf_argmax_agreement"])
        for index, result in enumerate(results):
            for setting in settings:
                deviation = result.by_label[setting.label].deviation
                writer.writerow([index, setting.label, deviation.kl, deviation.argmax_agreement])


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
