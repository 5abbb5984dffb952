"""Where the benchmarks write: bench/results/ (CSV, MD) and docs/ (PNG) of the checkout, or the one
directory RAGBLEND_BENCH_OUT names, so that a smoke run (bench/smoke.py) leaves both untouched."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_ENV = "RAGBLEND_BENCH_OUT"
# The committed folders. A benchmark that reads committed results as its input (cache_churn,
# the TTFT figures) reads them here whatever RAGBLEND_BENCH_OUT says: a smoke run's tiny figures
# are no model of anything.
COMMITTED_RESULTS = ROOT / "bench" / "results"
COMMITTED_PLOTS = ROOT / "docs"


def _folder(default: Path) -> Path:
    override = os.environ.get(OUT_ENV)
    folder = Path(override) if override else default
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def results_dir() -> Path:
    """bench/results/, or $RAGBLEND_BENCH_OUT; created when missing."""
    return _folder(COMMITTED_RESULTS)


def plots_dir() -> Path:
    """docs/, or $RAGBLEND_BENCH_OUT; created when missing."""
    return _folder(COMMITTED_PLOTS)


def shown(path: Path) -> str:
    """`path` as a "wrote ..." line prints it: relative to the checkout when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
