"""Kernel launches and read-backs of one prefill per layer, counted on the CPU: a proxy for the
host cost of the layer loop on a GPU that does not drift with the machine.

A random-init Llama of 32 layers and hidden size 64 makes compute negligible; op_count.py counts
the kernel-like ATen ops (about one launch each on CUDA) and the read-backs (each a sync there).
Counted for full_prefill, full_reuse and cacheblend at 4 and 16 chunks of 128 tokens, each
prefill called directly (`Prefiller.prefill`, on this thread) and served through the scheduler
as a lone request of one token (`Engine.generate`, its steps counted on the worker thread: the
step's scheduling and the first token's sampling, one read-back, included), with each layer's
chunk KV staged as on a GPU (the store's `stage_kv`).

    .venv/bin/python bench/prefill_launches.py            # ~15 s on 2 cores
Prints a table and writes bench/results/prefill_launches-cpu.csv.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import threading
from dataclasses import dataclass

from harness import build_model, random_layout, store_chunks, write_rows
from op_count import OpCount, counting

from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine
from engine.types import GenerateRequest, Mode
from kvstore.store import KVStore, KVStoreConfig


@dataclass
class Row:
    path: str  # direct or served
    mode: str
    chunks: int
    prompt_tokens: int
    kernels_per_layer: float  # kernel-like ATen ops over the prefill / layers
    aten_per_layer: float  # every ATen op, views included
    read_backs: int  # over the whole prefill
    check_layers: int
    vs_full_prefill: float = 0.0


def build_engine(args: argparse.Namespace) -> Engine:
    loaded = build_model("launch-proxy", "cpu", "float32")
    store = KVStore(
        KVStoreConfig(
            model_fingerprint=loaded.fingerprint,
            memory_budget_bytes=1 << 30,
            stage_kv=args.stage_kv,
        )
    )
    return Engine(loaded, store, max_num_seqs=2)


class Counted:
    """Profiles what the calling thread runs, or (`worker`) what the engine's worker thread runs
    in its steps (the profiler records the thread it was entered on)."""

    def __init__(self, engine: Engine, worker: bool):
        self.engine, self.worker = engine, worker
        self.count = OpCount()
        self._armed = False
        self._measured = threading.Event()
        if worker:
            step = engine.worker._step

            def profiled_step() -> None:
                if not self._armed:
                    step()
                    return
                self._measure(step)
                self._measured.set()

            engine.worker._step = profiled_step

    def _measure(self, run) -> None:
        with counting() as count:
            run()
        self.count += count

    def __call__(self, run) -> OpCount:
        self.count = OpCount()
        if self.worker:
            self._measured.clear()
            self._armed = True
            try:
                run()  # returns with the first token, which its step emits before it ends
                self._measured.wait()
            finally:
                self._armed = False
        else:
            self._measure(run)
        return self.count


def count(run, counter: Counted) -> OpCount:
    run()  # warm: the prefix cache, the rope tables, the loader thread
    return counter(run)


def first_token(mode: Mode, ratio: float | None) -> GenerateRequest:
    """A request for one token; the benchmark's layout replaces its text."""
    return GenerateRequest(question="?", mode=mode, recompute_ratio=ratio, max_tokens=1)


def prefill_whole(engine: Engine, layout, ask: PrefillAsk) -> None:
    """The prefill called directly, on this thread, driven to its end."""
    run_to_end(engine.prefiller.prefill(layout, ask))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument(
        "--stage-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack each layer's chunk KV into one staged tensor, as on a GPU (default: on)",
    )
    parser.add_argument("--names", action="store_true", help="print the leaf ops by name")
    args = parser.parse_args()

    engine = build_engine(args)
    layers = engine.ops.shape.num_layers
    checks = len(engine.prefiller.ratios.check_layers)
    counters = {"direct": Counted(engine, worker=False), "served": Counted(engine, worker=True)}
    rows = []
    try:
        for num_chunks in args.chunks:
            layout = random_layout(engine, num_chunks, args.chunk_tokens, args.question_tokens)
            store_chunks(engine, layout)
            cases = [
                (Mode.FULL_PREFILL, None),
                (Mode.FULL_REUSE, None),
                (Mode.CACHEBLEND, args.ratio),
            ]
            for (mode, ratio), path in itertools.product(cases, counters):
                run = (
                    functools.partial(prefill_whole, engine, layout, PrefillAsk(mode, ratio))
                    if path == "direct"
                    else functools.partial(engine.generate, first_token(mode, ratio), layout)
                )
                ops = count(run, counters[path])
                rows.append(
                    Row(
                        path,
                        mode.value,
                        num_chunks,
                        layout.num_tokens,
                        ops.kernels / layers,
                        ops.ops / layers,
                        ops.read_backs,
                        checks if mode is Mode.CACHEBLEND else 0,
                    )
                )
                if args.names:
                    print(path, mode.value, num_chunks, ops.names.most_common())
    finally:
        engine.close()
    full = {(r.path, r.chunks): r.kernels_per_layer for r in rows if r.mode == "full_prefill"}
    for row in rows:
        row.vs_full_prefill = row.kernels_per_layer / full[row.path, row.chunks]
    print(
        f"{'path':<8}{'mode':<14}{'chunks':>7}{'tokens':>8}{'kernels/layer':>15}"
        f"{'aten/layer':>12}{'read-backs':>12}{'vs full':>9}"
    )
    for r in rows:
        print(
            f"{r.path:<8}{r.mode:<14}{r.chunks:>7}{r.prompt_tokens:>8}"
            f"{r.kernels_per_layer:>15.1f}{r.aten_per_layer:>12.1f}{r.read_backs:>12}"
            f"{r.vs_full_prefill:>9.2f}"
        )
    write_rows("prefill_launches-cpu.csv", rows)


if __name__ == "__main__":
    main()
