"""Per-layer load and compute intervals of one prefill, and how much loading they overlapped.

Overlap is measured from recorded timestamps, never assumed.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of intervals."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in merge(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of union(a) ∩ union(b)."""
    a, b = merge(a), merge(b)
    i = j = 0
    covered = 0.0
    while i < len(a) and j < len(b):
        covered += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return covered


def overlap_fraction(loads: Iterable[Interval], computes: Iterable[Interval]) -> float:
    """The fraction of load time hidden behind compute (1.0 when nothing was loaded)."""
    loads = merge(loads)
    load_s = total(loads)
    if load_s == 0.0:
        return 1.0
    return intersection(loads, computes) / load_s
