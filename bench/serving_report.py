"""The output of bench/serving.py: CSV rows, the markdown tables, the TTFT and TPOT plot, and the
same rebuilt from the CSVs of an earlier run (`--from-csv`)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from paths import plots_dir, results_dir, shown
from serving_load import sustained_rate
from serving_overload import OVERLOAD_NOTE, TPOT_BOUND, blank, target_row, target_table
from serving_point import Point


def write_csv(path: Path, rows: list[dict], extra: dict) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*extra, *rows[0]])
        writer.writeheader()
        for row in rows:
            writer.writerow({**extra, **row})
    print(f"wrote {shown(path)}")


def point_row(p: Point) -> dict:
    row = {k: v for k, v in vars(p).items() if k != "ttft_samples"}
    return row


def markdown(
    points: list[Point],
    summary: list[dict],
    header: list[str],
) -> str:
    out = [*header, ""]
    if summary:
        out += [
            "### Serving: TTFT and TPOT under Poisson load",
            "",
            "| mode | scheduler | rate (req/s) | x 1/unloaded TTFT | x sustained | sent "
            "| completed | refused | unfinished | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (s) "
            "| TPOT p99 (s) | token gap p90 (s) | gap max (s) | queue p50 (s) | tokens/s "
            "| mean decode batch | drain (s) | p50 <= 2x unloaded |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
            "|---:|---:|:---:|",
        ]
        for p in [p for p in points if not p.rerun]:
            out.append(
                f"| {p.mode} | {p.scheduler} | {p.rate:.3f} | {p.rate_fraction:.2f} "
                f"| {blank(p.overload_factor, '.2f')} | {p.sent} | {p.completed} | {p.refused} "
                f"| {p.unfinished} | {p.ttft_p50_s:.3f} | {p.ttft_p99_s:.3f} "
                f"| {blank(p.tpot_p50_s, '.4f')} | {blank(p.tpot_p99_s, '.4f')} "
                f"| {blank(p.gap_p90_s)} | {blank(p.gap_max_s)} | {p.queue_p50_s:.3f} "
                f"| {p.tokens_per_s:.1f} | {p.mean_decode_batch:.1f} "
                f"| {blank(p.drain_s, '.1f')} | {'yes' if p.sustained else 'no'} |"
            )
        out += [
            "",
            "### Highest sustained rate (TTFT p50 <= 2x unloaded TTFT)",
            "",
            "| mode | scheduler | unloaded TTFT (s) | unloaded TPOT (s) | unloaded request (s) "
            "| sustained rate (req/s) | cacheblend / full_prefill |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        by = {(s["mode"], s["scheduler"]): s for s in summary}
        for s in summary:
            full = by.get(("full_prefill", s["scheduler"]))
            ratio = ""
            if s["mode"] == "cacheblend" and full:
                ratio = f"{s['sustained_rate'] / full['sustained_rate']:.2f}x"
            how = "" if s["sustained_how"] == "~" else s["sustained_how"] + " "
            out.append(
                f"| {s['mode']} | {s['scheduler']} | {s['unloaded_ttft_s']:.3f} "
                f"| {blank(s.get('unloaded_tpot_s', math.nan), '.4f')} "
                f"| {s['unloaded_request_s']:.3f} | {how}{s['sustained_rate']:.3f} | {ratio} |"
            )
        out += [
            "",
            "Sustained rate: interpolated linearly between the last rate-fraction point that "
            "meets the bound and the first that does not ('>=': every point met it; '<': none "
            "did).",
        ]
        if any(not math.isnan(p.overload_factor) for p in points):
            out += ["", OVERLOAD_NOTE]
        out += target_table([r for s in summary if (r := target_row(points, s)) is not None])
    return "\n".join(out) + "\n"


def plot(points: list[Point], summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    axes[1].sharey(axes[0])
    colors = {
        ("full_prefill", "batching"): "tab:red",
        ("full_prefill", "one-at-a-time"): "tab:orange",
        ("cacheblend", "batching"): "tab:blue",
        ("cacheblend", "one-at-a-time"): "tab:cyan",
    }
    panels = (
        (axes[0], "ttft_p50_s", "TTFT p50"),
        (axes[1], "ttft_p99_s", "TTFT p99"),
        (axes[2], "tpot_p99_s", "TPOT p99"),
    )
    for ax, key, name in panels:
        for (mode, scheduler), color in colors.items():
            series = sorted(
                (p for p in points if p.mode == mode and p.scheduler == scheduler and not p.rerun),
                key=lambda p: p.rate,
            )
            # Rows from an older CSV have no TPOT: nothing to draw (log axes refuse it).
            if all(math.isnan(getattr(p, key)) for p in series):
                continue
            ax.plot(
                [p.rate for p in series],
                [getattr(p, key) for p in series],
                marker="o",
                color=color,
                linestyle="-" if scheduler == "batching" else "--",
                label=f"{mode}, {scheduler}",
            )
        for s in summary:
            if s["scheduler"] == "batching":
                color = colors[(s["mode"], "batching")]
                bound = (
                    TPOT_BOUND * s.get("unloaded_tpot_s", math.nan)
                    if key.startswith("tpot")
                    else 2 * s["unloaded_ttft_s"]
                )
                if not math.isnan(bound):
                    ax.axhline(bound, color=color, linestyle=":", linewidth=1)
        if ax.lines:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("TTFT (s, queueing included)")
    axes[2].set_ylabel("TPOT (s per output token after the first)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        title + f"  (dotted: 2x unloaded TTFT, {TPOT_BOUND:g}x unloaded TPOT)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {shown(path)}")


def _read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _number(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(value, value)


def _values(row: dict, drop: tuple[str, ...]) -> dict:
    """A CSV row's numbers; empty cells (rows merged from an older CSV) are left out, so they
    take the field's default."""
    return {k: _number(v) for k, v in row.items() if k not in drop and v != ""}


def rebuild_from_csv(tag: str) -> None:
    """Tables and plot from bench/results/serving-<tag>*.csv; the header of the existing .md
    (everything before the first table) is kept."""
    drop = ("device", "shape", "dtype")
    results = results_dir()
    raw = _read_csv(results / f"serving-{tag}.csv")
    extra = {k: v for k, v in raw[0].items() if k in drop} if raw else {}
    points = [Point(**_values(r, drop)) for r in raw]
    summary = [_values(r, drop) for r in _read_csv(results / f"serving-{tag}-summary.csv")]
    for s in summary:
        mine = [p for p in points if p.mode == s["mode"] and p.scheduler == s["scheduler"]]
        for p in mine:
            p.sustained = p.ttft_p50_s <= 2 * s["unloaded_ttft_s"] and p.refused == 0
        # The overload rows sit past the sustained rate by construction: they do not move it.
        rated = [p for p in mine if math.isnan(p.overload_factor) and not p.rerun]
        s["sustained_rate"], s["sustained_how"] = sustained_rate(rated, s["unloaded_ttft_s"])
    points.sort(
        key=lambda p: (
            p.scheduler != "batching",
            p.mode != "full_prefill",
            not math.isnan(p.overload_factor),
            p.rate,
        )
    )
    md = results / f"serving-{tag}.md"
    header = md.read_text().split("\n### ")[0].rstrip("\n").split("\n") if md.exists() else []
    md.write_text(markdown(points, summary, header))
    print(f"wrote {shown(md)}")
    write_csv(results / f"serving-{tag}-summary.csv", summary, extra)
    if points:
        title = " ".join(str(extra.get(k, "")) for k in ("shape", "dtype", "device"))
        plot(points, summary, plots_dir() / f"serving-{tag}.png", f"{title}: serving-{tag}.csv")
