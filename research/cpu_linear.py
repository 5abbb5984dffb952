"""A decode step's time by batch on the CPU, nn.Linear against linear weights prepacked for
oneDNN (`cpu_prepacked_linear`), side by side in one run on two copies of one model.

    .venv/bin/python research/cpu_linear.py            # llama-124m float32, ~1 min on 2 cores

MKL's sgemm repacks each weight on every call of 2 or more rows, so a decode batch of 2 costs
about twice a lone one; the prepacked layout reads each weight once. Writes
bench/results/cpu_linear-cpu.csv (batch, context, both step times, their ratio).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import _on_path  # noqa: F401  (bench/ on sys.path)
import torch
from harness import build_model, interleaved_medians, write_rows

from engine.model.cpu_linear import prepack_linears
from engine.model.layers import LayerOps
from engine.runner.model_runner import ModelRunner

NAMES = ("nn", "prepacked")


@dataclass(frozen=True)
class Row:
    batch: int
    context: int
    nn_linear_s: float
    prepacked_s: float
    prepacked_vs_nn_linear: float


def runner(prepacked: bool, context: int, batch: int) -> ModelRunner:
    loaded = build_model("llama-124m", "cpu", "float32")
    if prepacked:
        prepack_linears(loaded.model)
    blocks_per_seq = context // 16 + 1
    return ModelRunner(LayerOps(loaded.model), blocks_per_seq * batch, 16, context + 16, batch)


def decoding(r: ModelRunner, batch: int, per: int, context: int) -> Callable[[], object]:
    """One decode step of `batch` sequences of `context` positions, each in its own blocks."""
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    return lambda: r.decode(tables, [context] * batch, [5] * batch)


def noop() -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="batches 1 2, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.repeats = [1, 2], 2
    torch.set_num_threads(min(2, torch.get_num_threads()))
    most = max(args.batches)
    runners = {name: runner(name == "prepacked", args.context, most) for name in NAMES}
    per = args.context // 16 + 1
    rows = []
    with torch.inference_mode():
        for batch in args.batches:
            cases = {
                name: (decoding(r, batch, per, args.context), noop) for name, r in runners.items()
            }
            times = interleaved_medians(cases, args.repeats, torch.device("cpu"))
            nn_s, packed_s = times["nn"][0], times["prepacked"][0]
            rows.append(Row(batch, args.context, nn_s, packed_s, packed_s / nn_s))
            print(
                f"batch {batch:3d}: nn.Linear {nn_s * 1e3:7.1f} ms, prepacked "
                f"{packed_s * 1e3:7.1f} ms ({packed_s / nn_s:.2f}x)",
                flush=True,
            )
    write_rows("cpu_linear-cpu.csv", rows)


if __name__ == "__main__":
    main()
