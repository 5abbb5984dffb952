"""A lone request served through the scheduler against the same prefill called directly: time to
the first token of each, side by side (interleaved medians), for full_prefill, full_reuse and
cacheblend, with each layer's chunk KV staged as on a GPU (the store's `stage_kv`).

Direct: `Prefiller.prefill` into a buffer of its own, then the first token from its logits.
Served: `Engine.generate` of one token, the prompt's KV written into its blocks of the pool;
timed from the call to its return, the worker thread's hand-offs included.

    .venv/bin/python bench/served_ttft.py                # ~2 min on 2 cores
Prints a table and writes bench/results/served_ttft-<device>.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch
from harness import (
    add_workload_arguments,
    build_store,
    interleaved_medians,
    model_label,
    random_layout,
    results_name,
    store_chunks,
    workload_model,
    write_rows,
)

from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine
from engine.types import GenerateRequest, Mode
from kvstore.store import KVStore


@dataclass
class Row:
    device: str
    model: str
    dtype: str
    mode: str
    chunks: int
    prompt_tokens: int
    direct_s: float
    served_s: float
    served_vs_direct: float


def build_engine(args: argparse.Namespace) -> Engine:
    loaded = workload_model(args)
    store = build_store(loaded)
    if args.stage_kv and loaded.device.type == "cpu":  # layers are always staged off the CPU
        config = dataclasses.replace(store.config, stage_kv=True)
        store.close()
        store = KVStore(config)
    return Engine(loaded, store, max_num_seqs=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.set_defaults(chunks=16, chunk_tokens=128 if not torch.cuda.is_available() else 512)
    parser.add_argument(
        "--stage-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on the CPU, stage each layer's chunk KV as on a GPU (default: on)",
    )
    args = parser.parse_args()

    engine = build_engine(args)
    layout = random_layout(engine, args.chunks, args.chunk_tokens, args.question_tokens)
    store_chunks(engine, layout)
    cases = [(Mode.FULL_PREFILL, None), (Mode.FULL_REUSE, None), (Mode.CACHEBLEND, args.ratio)]

    def direct(mode: Mode, ratio: float | None):
        def run():
            prefill = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(mode, ratio)))
            return int(prefill.output.logits.argmax())  # the first token

        return run

    def served(mode: Mode, ratio: float | None):
        request = GenerateRequest(question="?", mode=mode, recompute_ratio=ratio, max_tokens=1)
        return lambda: engine.generate(request, layout).token_ids[0]

    timed = {}
    for mode, ratio in cases:
        timed[mode, "direct"] = (direct(mode, ratio), lambda: None)
        timed[mode, "served"] = (served(mode, ratio), lambda: None)
    try:
        measured = interleaved_medians(timed, args.repeats, engine.device)
    finally:
        engine.close()

    label = model_label(args)
    rows = [
        Row(
            args.device,
            label,
            args.dtype,
            mode.value,
            args.chunks,
            layout.num_tokens,
            measured[mode, "direct"][0],
            measured[mode, "served"][0],
            measured[mode, "served"][0] / measured[mode, "direct"][0],
        )
        for mode, _ in cases
    ]
    print(
        f"\n{label} {args.dtype} on {args.device}: {layout.num_tokens} prompt tokens "
        f"({args.chunks} chunks x {args.chunk_tokens}), KV staged: {args.stage_kv}, "
        f"median of {args.repeats} interleaved rounds"
    )
    print(f"{'mode':<14}{'direct s':>10}{'served s':>10}{'served/direct':>15}")
    for row in rows:
        print(
            f"{row.mode:<14}{row.direct_s:>10.4f}{row.served_s:>10.4f}{row.served_vs_direct:>15.3f}"
        )
    write_rows(results_name(args, "served_ttft"), rows)


if __name__ == "__main__":
    main()
