"""Overload points of bench/serving.py: rates at factors of a (mode, scheduler)'s sustained rate,
and the overload target at 1.5x: every admitted request completes, TPOT p99 stays within 3x an
unloaded TPOT measured just before and after the point (the median of requests alone), and
throughput holds: its tokens/s is not below the peak of the lower-rate points, those at most at the
1.2x overload point's rate. The points compared are rerun in turn and compared by their medians (the
machine's speed drifts within a run; alternation cancels it). Beside it, the peak of every lower
rate, sweep points between 1.2x and 1.5x included."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving_point import Point

TARGET_FACTOR = 1.5
TPOT_BOUND = 3.0  # x the unloaded TPOT
# The lower rates the throughput criterion compares with: at most the 1.2x overload point's. A
# sweep point between 1.2x and 1.5x lies past capacity like the target and measures the same
# saturated throughput at nearly its rate: the two differ by the runs' spread either way.
CLEAR_FACTOR = 1.2

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


def target_point(points: list[Point]) -> Point | None:
    """The sweep's point at TARGET_FACTOR among one (mode, scheduler)'s points."""
    at = [p for p in points if math.isclose(p.overload_factor, TARGET_FACTOR) and not p.rerun]
    return at[0] if at else None


def lower_rates(points: list[Point], target: Point) -> tuple[list[Point], list[Point]]:
    """The sweep's points below the target's rate: those at most at the CLEAR_FACTOR point's
    rate (the criterion's), and all of them."""
    lower = [q for q in points if q.rate < target.rate and not q.rerun]
    clear_rate = target.rate * CLEAR_FACTOR / TARGET_FACTOR * (1 + 1e-9)
    return [q for q in lower if q.rate <= clear_rate], lower


def rerun_points(points: list[Point]) -> list[Point]:
    """The target point, then the point of highest tokens/s at the criterion's lower rates and,
    where another, at every lower rate: the points to rerun in turn."""
    target = target_point(points)
    if target is None:
        return []
    peaks = [max(g, key=lambda p: p.tokens_per_s) for g in lower_rates(points, target) if g]
    if len(peaks) == 2 and peaks[0] is peaks[1]:
        peaks.pop()
    return [target, *peaks] if peaks else []


def runs_tokens_per_s(points: list[Point], point: Point) -> list[float]:
    """The tokens/s of `point` and of its reruns."""
    key = (point.mode, point.scheduler, point.rate)
    return [p.tokens_per_s for p in points if (p.mode, p.scheduler, p.rate) == key]


def target_row(points: list[Point], summary: dict) -> dict | None:
    """The target at the TARGET_FACTOR point of one (mode, scheduler), None without one. A
    criterion whose inputs are missing (an older CSV without TPOT) is None."""
    mine = [p for p in points if p.mode == summary["mode"] and p.scheduler == summary["scheduler"]]
    p = target_point(mine)
    if p is None:
        return None
    admitted = p.sent - p.refused
    unloaded_tpot = p.unloaded_tpot_s
    if math.isnan(unloaded_tpot):  # a CSV from before the point's own baseline
        unloaded_tpot = float(summary.get("unloaded_tpot_s", math.nan))
    tpot_bound = TPOT_BOUND * unloaded_tpot
    target_runs = runs_tokens_per_s(mine, p)
    throughput, runs = statistics.median(target_runs), len(target_runs)
    clear_lower, lower = lower_rates(mine, p)
    peak, peak_point = _peak_of(mine, clear_lower)
    peak_runs = [] if peak_point is None else runs_tokens_per_s(mine, peak_point)
    every, every_point = _peak_of(mine, lower)
    every_runs = [] if every_point is None else runs_tokens_per_s(mine, every_point)
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
        "throughput": throughput,
        "runs": runs,
        "throughput_range": (min(target_runs), max(target_runs)),
        "peak_throughput": peak,
        "peak_rate": math.nan if peak_point is None else peak_point.rate,
        "peak_range": _bounds(peak_runs),
        "throughput_ok": None if math.isnan(peak) else throughput >= peak,
        "every_peak_throughput": every,
        "every_peak_rate": math.nan if every_point is None else every_point.rate,
        "every_peak_range": _bounds(every_runs),
    }


def _peak_of(points: list[Point], candidates: list[Point]) -> tuple[float, Point | None]:
    """The highest median tokens/s (over each point's runs) among `candidates`, and its point."""
    by_median = {statistics.median(runs_tokens_per_s(points, q)): q for q in candidates}
    peak = max(by_median, default=math.nan)
    return peak, by_median.get(peak)


def target_text(row: dict) -> str:
    return (
        f"every admitted completed {_yes(row['all_completed'])} "
        f"({row['completed']}/{row['admitted']}), TPOT p99 {row['tpot_p99_s']:.3f} <= "
        f"{TPOT_BOUND:g}x unloaded {row['tpot_bound_s']:.3f} {_yes(row['tpot_ok'])}, "
        f"{row['throughput']:.1f} tok/s (median of {row['runs']} runs) >= the peak at <= "
        f"{CLEAR_FACTOR:g}x sustained {_peak(row, 'peak')} "
        f"({_change(row, row['peak_throughput'])}) {_yes(row['throughput_ok'])}; "
        f"every lower rate's peak {_peak(row, 'every_peak')} "
        f"({_change(row, row['every_peak_throughput'])})"
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
        "| tokens/s, runs (min-max) "
        f"| peak at <= {CLEAR_FACTOR:g}x sustained: tokens/s (min-max) at req/s "
        "| vs peak | >= peak | target met "
        "| peak of every lower rate: tokens/s (min-max) at req/s | vs it |",
        "|---|---|---:|---:|---:|:---:|---:|---:|:---:|---:|---:|---:|:---:|:---:|---:|---:|",
    ]
    for r in rows:
        checks = (r["all_completed"], r["tpot_ok"], r["throughput_ok"])
        met = None if None in checks else all(checks)
        out.append(
            f"| {r['mode']} | {r['scheduler']} | {r['rate']:.3f} | {r['admitted']} "
            f"| {r['completed']} | {_yes(r['all_completed'])} | {blank(r['tpot_p99_s'])} "
            f"| {blank(r['tpot_bound_s'])} | {_yes(r['tpot_ok'])} "
            f"| {r['throughput']:.1f}, {r['runs']} ({_range(r['throughput_range'])}) "
            f"| {_peak(r, 'peak')} | {_change(r, r['peak_throughput'])} "
            f"| {_yes(r['throughput_ok'])} | {_yes(met)} "
            f"| {_peak(r, 'every_peak')} | {_change(r, r['every_peak_throughput'])} |"
        )
    out += [
        "",
        "Admitted: sent less refused (the 429s). TPOT p99 against 3x the median TPOT of "
        "requests alone measured just before and after the point. Throughput: the median "
        "tokens/s over the point and its reruns (runs). The lower-rate points of the throughput "
        f"criterion: this (mode, scheduler)'s points at most at the {CLEAR_FACTOR:g}x overload "
        "point's rate (that point included); their peak is the highest median tokens/s. The "
        "target and the peak's point are rerun in turn after the sweep (--throughput-rounds), so "
        "the machine's drift within the run weighs on both alike; an older run without "
        "reruns compares single runs. The last two columns compare with every lower rate, sweep "
        f"points between {CLEAR_FACTOR:g}x and {TARGET_FACTOR:g}x the sustained rate included "
        "(rerun too): such a point lies past capacity like the target, at nearly its rate, and "
        "measures the same saturated throughput, so the two medians differ by about the runs' "
        "spread either way. TPOT: (last token - first token) / (tokens - 1) per request.",
    ]
    return out


def _range(bounds: tuple[float, float]) -> str:
    low, high = bounds
    return "" if math.isnan(low) else f"{low:.1f}-{high:.1f}"


def _change(row: dict, peak: float) -> str:
    """The target's median tokens/s against a peak's, in per cent ("" without a peak, or one of
    no tokens: a smoke run's points may answer none)."""
    if math.isnan(peak) or peak <= 0.0:
        return ""
    return f"{100 * (row['throughput'] / peak - 1):+.1f} %"


def _peak(row: dict, key: str) -> str:
    """A peak ('peak' or 'every_peak') with its runs' range and its rate."""
    if math.isnan(row[f"{key}_throughput"]):
        return ""
    return (
        f"{row[f'{key}_throughput']:.1f} ({_range(row[f'{key}_range'])}) "
        f"at {row[f'{key}_rate']:.3f}"
    )


def _bounds(runs: list[float]) -> tuple[float, float]:
    return (min(runs), max(runs)) if runs else (math.nan, math.nan)


def blank(value: float, spec: str = ".3f") -> str:
    """The value formatted, blank where it is missing (nan: a column an older CSV lacks)."""
    return "" if math.isnan(value) else format(value, spec)
