"""Puts bench/ (the product benchmarks' harness) and the checkout on sys.path, so that a
research script run as `python research/NAME.py` imports them as the benchmarks do."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
