"""Overload points of bench/serving.py: rates at factors of a (mode, scheduler)'s sustained rate,
and the overload target at 1.5x: every admitted request completes, TPOT p99 stays within 3x an
unloaded TPOT measured just before the point, and throughput holds (tokens/s per unloaded TPOT
of each point's own moment)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving_point import Point

TARGET_FACTOR = 1.5
TPOT_BOUND = 3.0  # x the unloaded TPOT

OVERLOAD_NOTE = (
    "Overload rows: the factor ('x sustained') multiplies the sustained rate above; where it "
    "is '<' (no rate point met the bound) the lowest rate measured, where '>=' (every point "
    "met it) the highest, a lower bound, so those rows may not overload. Each point waits after "
    "its last arrival until every admitted request has answered (or a cap: 'unfinished')."
)


def overload_rates(sustained_rate: float, factors: list[float]) -> list[tuple[float, float]]:
    """(factor, rate) per overload factor."""
    return [(factor, factor * sustained_rate) for factor in factors]


def _yes(value: bool | None) -> str:
    return "" if value is None else ("yes" if value else "no")


def target_row(points: list[Point], summary: dict) -> dict | None:
    """The target at the TARGET_FACTOR point of one (mode, scheduler), None without one. A
    criterion whose inputs are missing (an older CSV without TPOT) is None."""
    mine = [p for p in points if p.mode == summary["mode"] and p.scheduler == summary["scheduler"]]
    at = [p for p in mine if math.isclose(p.overload_factor, TARGET_FACTOR)]
    if not at:
        return None
    p = at[0]
    admitted = p.sent - p.refused
    unloaded_tpot = p.unloaded_tpot_s
    if math.isnan(unloaded_tpot):  # a CSV from before the point's own baseline
        unloaded_tpot = float(summary.get("unloaded_tpot_s", math.nan))
    tpot_bound = TPOT_BOUND * unloaded_tpot
    # Throughput in tokens per unloaded TPOT of its own moment where every point has one: the
    # machine's speed drifts between points minutes apart, and the ratio cancels it.
    lower = [q for q in mine if q.rate < p.rate]
    normalised = all(not math.isnan(q.unloaded_tpot_s) for q in [p, *lower])
    scale = (lambda q: q.unloaded_tpot_s) if normalised else (lambda q: 1.0)
    peak = max((q.tokens_per_s * scale(q) for q in lower), default=math.nan)
    return {
        "mode": p.mode,
        "scheduler": p.scheduler,
        "rate": p.rate,
        "admitted": admitted,
        "completed": p.completed,
        "all_completed": p.completed == admitted,
        "tpot_p99_s": p.tpot_p99_s,
        "tpot_bound_s": tpot_bound,
        "tpot_ok": None if math.isnan(tpot_bound) else p.tpot_p99_s <= tpot_bound,
        "tokens_per_s": p.tokens_per_s,
        "throughput": p.tokens_per_s * scale(p),
        "peak_throughput": peak,
        "throughput_unit": "tokens per unloaded TPOT" if normalised else "tokens/s",
        "throughput_ok": None if math.isnan(peak) else p.tokens_per_s * scale(p) >= peak,
    }


def target_text(row: dict) -> str:
    return (
        f"every admitted completed {_yes(row['all_completed'])} "
        f"({row['completed']}/{row['admitted']}), TPOT p99 {row['tpot_p99_s']:.3f} <= "
        f"{TPOT_BOUND:g}x unloaded {row['tpot_bound_s']:.3f} {_yes(row['tpot_ok'])}, "
        f"{row['throughput']:.2f} {row['throughput_unit']} >= lower-rate peak "
        f"{row['peak_throughput']:.2f} {_yes(row['throughput_ok'])}"
    )


def target_table(rows: list[dict]) -> list[str]:
    """Markdown lines of the overload target, one row per (mode, scheduler)."""
    if not rows:
        return []
    out = [
        "",
        f"### Overload target at {TARGET_FACTOR:g}x the sustained rate",
        "",
        "| mode | scheduler | rate (req/s) | admitted | completed | every admitted completed "
        f"| TPOT p99 (s) | {TPOT_BOUND:g}x unloaded TPOT (s) | TPOT p99 <= {TPOT_BOUND:g}x "
        "| tokens/s | throughput | lower-rate peak | >= peak | target met |",
        "|---|---|---:|---:|---:|:---:|---:|---:|:---:|---:|---:|---:|:---:|:---:|",
    ]
    for r in rows:
        checks = (r["all_completed"], r["tpot_ok"], r["throughput_ok"])
        met = None if None in checks else all(checks)
        out.append(
            f"| {r['mode']} | {r['scheduler']} | {r['rate']:.3f} | {r['admitted']} "
            f"| {r['completed']} | {_yes(r['all_completed'])} | {blank(r['tpot_p99_s'])} "
            f"| {blank(r['tpot_bound_s'])} | {_yes(r['tpot_ok'])} | {r['tokens_per_s']:.1f} "
            f"| {r['throughput']:.2f} {r['throughput_unit']} "
            f"| {blank(r['peak_throughput'], '.2f')} | {_yes(r['throughput_ok'])} "
            f"| {_yes(met)} |"
        )
    out += [
        "",
        "Admitted: sent less refused (the 429s). Throughput: tokens/s x the TPOT of one request "
        "alone measured just before the point (tokens per unloaded TPOT: the machine's speed "
        "drifts between points, and the product cancels it; plain tokens/s for a run without "
        "those baselines). Lower-rate peak: the highest throughput of this (mode, scheduler)'s "
        "points at lower rates. TPOT: (last token - first token) / (tokens - 1) per request.",
    ]
    return out


def blank(value: float, spec: str = ".3f") -> str:
    """The value formatted, blank where it is missing (nan: a column an older CSV lacks)."""
    return "" if math.isnan(value) else format(value, spec)
