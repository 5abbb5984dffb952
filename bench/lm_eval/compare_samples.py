"""Compare two lm-evaluation-harness runs of a loglikelihood task, request by request: the
largest difference of their log-likelihoods and how many greedy flags and scores differ.

    python bench/lm_eval/compare_samples.py OUT_A OUT_B   (each run's --output_path)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def samples(output_path: str) -> dict[int, dict]:
    (path,) = Path(output_path).glob("*/samples_*.jsonl")
    with path.open() as lines:
        return {row["doc_id"]: row for row in map(json.loads, lines)}


def main(first: str, second: str) -> None:
    a, b = samples(first), samples(second)
    assert a.keys() == b.keys(), "the runs scored different documents"
    gaps, greedy_differs = [], 0
    for doc_id, row in a.items():
        for (mine,), (theirs,) in zip(row["resps"], b[doc_id]["resps"], strict=True):
            gaps.append(abs(float(mine[0]) - float(theirs[0])))
            greedy_differs += mine[1] != theirs[1]
    acc_differs = sum(row["acc"] != b[doc_id]["acc"] for doc_id, row in a.items())
    print(
        f"{len(gaps)} loglikelihood requests: max |difference| {max(gaps):.2e}, "
        f"mean {sum(gaps) / len(gaps):.2e}; greedy flags differing {greedy_differs}; "
        f"documents scored differently {acc_differs} of {len(a)}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
