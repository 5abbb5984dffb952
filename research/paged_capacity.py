"""Paged KV against fixed slots: concurrent sequences for the same pool bytes (counted with the
engine's BlockManager and Scheduler admission), and the CPU decode step time of both.

1. Capacity. A pool of `--slots` slots of max_model_len 8192 (what fixed slots admit at once,
   whatever the prompts) cut into 16-token blocks instead; prompts drawn from 256 to 8192
   tokens, uniform and log-uniform, each with `max_tokens` output reserved (capped so prompt
   plus output fit 8192). The scheduler admits the queued sequences FIFO while their blocks
   are free; the count is the mean over `--trials` draws.
2. Decode step. One batched decode step through block tables (engine/runner.py), its per-row
   attention over views of the blocks (the CPU's) and its batched one over gathered blocks,
   against the slot decode it replaced (tests/engine/slot_reference.py), same model, batch
   and context, timed round-robin; every sequence's blocks are one run, as admission
   reserves them in an unfragmented pool.
3. Shared prompt prefix. Capacity as in 1 when every prompt starts with one `--prefix`-token
   system prompt (the draw follows it), held once in the pool (engine/shared_prefix.py) or
   by every sequence; and the decode step of rows whose blocks are that prefix's then their
   own (two runs), read as views merged by log-sum-exp or gathered, against one run.
Prints tables; writes bench/results/paged_capacity.csv, paged_decode-cpu.csv,
paged_capacity_shared_prefix.csv and paged_decode_shared_prefix-cpu.csv (--sections picks).
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the reference in tests/

import _on_path  # noqa: E402, F401  (bench/ on sys.path)
from harness import SHAPES, build_model, default_dtype, interleaved_medians  # noqa: E402
from paths import results_dir, shown  # noqa: E402

from engine.model.layers import LayerOps  # noqa: E402
from engine.model.paged_attention import MAX_VIEW_RUNS  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from engine.sched.blocks import BlockManager
from engine.sched.scheduler import Scheduler  # noqa: E402
from engine.sched.sequence import Sequence  # noqa: E402
from engine.types import DEFAULT_BLOCK_SIZE  # noqa: E402
from kvstore.types import kv_token_bytes  # noqa: E402
from tests.engine.slot_reference import SlotPool  # noqa: E402

MODEL_LEN = 8192
MIN_PROMPT = 256
SECTIONS = ("capacity", "decode", "shared-capacity", "shared-decode")


def draw_prompt(rng: random.Random, distribution: str) -> int:
    if distribution == "uniform":
        return rng.randint(MIN_PROMPT, MODEL_LEN)
    return round(math.exp(rng.uniform(math.log(MIN_PROMPT), math.log(MODEL_LEN))))


def admitted(
    num_blocks: int, prompts: list[int], max_tokens: int, prefix: tuple[int, ...] = ()
) -> int:
    """Sequences the scheduler admits at once into an empty pool of `num_blocks`; with a shared
    `prefix`, the first sequence's prefill completes first (its prefix registered) and the
    rest are admitted after it."""
    blocks = BlockManager(num_blocks, DEFAULT_BLOCK_SIZE)
    # Lanes, queue and prefill budget as large as the draw: only the blocks bound admission.
    scheduler: Scheduler[Sequence] = Scheduler(
        blocks,
        max_num_seqs=len(prompts),
        max_waiting=len(prompts),
        max_prefill_tokens=sum(prompts),
        shared_prefixes=1 if prefix else 0,
    )
    seqs = [
        Sequence(
            num_prompt_tokens=min(prompt, MODEL_LEN - max_tokens),
            max_tokens=max_tokens,
            shared_prefix=prefix,
        )
        for prompt in prompts
    ]
    scheduler.add(seqs[0])
    scheduler.schedule()
    seqs[0].num_cached = seqs[0].num_prompt_tokens
    for seq in seqs[1:]:
        scheduler.add(seq)
    scheduler.schedule()
    return len(scheduler.running)


def shared_capacity(args: argparse.Namespace) -> list[dict]:
    """Concurrent sequences when every prompt starts with one system prompt of `args.prefix`
    tokens, shared in the pool or not, per distribution and output."""
    num_blocks = args.slots * MODEL_LEN // DEFAULT_BLOCK_SIZE
    prefix = tuple(range(args.prefix))
    rows = []
    for distribution in ("uniform", "log-uniform"):
        for max_tokens in args.max_tokens:
            rng = random.Random(0)
            counts: dict[bool, list[int]] = {False: [], True: []}
            for _ in range(args.trials):
                prompts = [
                    args.prefix + draw_prompt(rng, distribution) for _ in range(40 * args.slots)
                ]
                for shared in counts:
                    counts[shared].append(
                        admitted(num_blocks, prompts, max_tokens, prefix if shared else ())
                    )
            unshared, shared_mean = (sum(counts[k]) / len(counts[k]) for k in (False, True))
            rows.append(
                {
                    "distribution": distribution,
                    "max_tokens": max_tokens,
                    "prefix_tokens": args.prefix,
                    "pool_tokens": num_blocks * DEFAULT_BLOCK_SIZE,
                    "unshared_sequences": unshared,
                    "shared_sequences": shared_mean,
                    "shared_min": min(counts[True]),
                    "ratio": shared_mean / unshared,
                }
            )
    return rows


def capacity(args: argparse.Namespace) -> list[dict]:
    """Concurrent sequences for the pool of `args.slots` slots, per distribution and output."""
    num_blocks = args.slots * MODEL_LEN // DEFAULT_BLOCK_SIZE
    rows = []
    for distribution in ("uniform", "log-uniform"):
        for max_tokens in args.max_tokens:
            rng = random.Random(0)
            counts, means = [], []
            for _ in range(args.trials):
                # More than can fit, so that admission stops at the pool, not the queue.
                prompts = [draw_prompt(rng, distribution) for _ in range(40 * args.slots)]
                counts.append(admitted(num_blocks, prompts, max_tokens))
                means.append(sum(prompts[: counts[-1]]) / counts[-1])
            paged = sum(counts) / len(counts)
            rows.append(
                {
                    "distribution": distribution,
                    "max_tokens": max_tokens,
                    "pool_tokens": num_blocks * DEFAULT_BLOCK_SIZE,
                    "fixed_slots": args.slots,
                    "paged_sequences": paged,
                    "paged_min": min(counts),
                    "ratio": paged / args.slots,
                    "mean_prompt": sum(means) / len(means),
                }
            )
    return rows


def decode_times(args: argparse.Namespace) -> list[dict]:
    """One decode step, paged and slot view, per (batch, context)."""
    loaded = build_model(args.shape, "cpu", args.dtype)
    ops = LayerOps(loaded.model)
    most, model_len = max(args.batches), max(args.contexts) + 1
    per_seq = -(-model_len // DEFAULT_BLOCK_SIZE)
    paged = ModelRunner(ops, most * per_seq, DEFAULT_BLOCK_SIZE, model_len, most)
    slots = SlotPool(ops, most, model_len)
    pool = BlockManager(paged.num_blocks, DEFAULT_BLOCK_SIZE)
    tables = [pool.allocate(b, model_len) for b in range(most)]
    rng = random.Random(0)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            tokens = [rng.randrange(1000, 30000) for _ in range(batch)]
            positions = [context] * batch
            paged_step = partial(paged.decode, tables[:batch], positions, tokens)
            cases = {
                "paged": (paged_step, partial(paged.use_attention, "per_row")),
                "paged_batched": (paged_step, partial(paged.use_attention, "batched")),
                "slot": (partial(slots.decode, list(range(batch)), positions, tokens), _nothing),
            }
            times = interleaved_medians(cases, args.repeats, loaded.device)
            row = {"batch": batch, "context": context}
            row.update({f"{name}_step_s": times[name][0] for name in cases})
            row["paged_vs_slot"] = row["paged_step_s"] / row["slot_step_s"]
            row["paged_batched_vs_slot"] = row["paged_batched_step_s"] / row["slot_step_s"]
            rows.append(row)
            print(
                f"  batch {batch:2d} context {context:5d}: paged per row "
                f"{row['paged_step_s'] * 1e3:7.2f} ms, paged batched (gather) "
                f"{row['paged_batched_step_s'] * 1e3:7.2f} ms, slot view "
                f"{row['slot_step_s'] * 1e3:7.2f} ms",
                flush=True,
            )
    return rows


def shared_decode_times(args: argparse.Namespace) -> list[dict]:
    """One decode step of rows behind a shared prefix of `args.prefix` tokens (two block runs),
    read as views merged by log-sum-exp or gathered, against rows of one run, per (batch,
    context)."""
    loaded = build_model(args.shape, "cpu", args.dtype)
    ops = LayerOps(loaded.model)
    most, model_len = max(args.batches), max(args.contexts) + 1
    per_seq = -(-model_len // DEFAULT_BLOCK_SIZE)
    paged = ModelRunner(ops, 2 * most * per_seq, DEFAULT_BLOCK_SIZE, model_len, most)
    pool = BlockManager(paged.num_blocks, DEFAULT_BLOCK_SIZE)
    one_run = [pool.allocate(b, model_len) for b in range(most)]
    pool.allocate("prefix", args.prefix)
    shared = []
    for b in range(most):
        pool.fork("prefix", ("shared", b))
        pool.append_slots(("shared", b), model_len - args.prefix)
        shared.append(pool.block_table(("shared", b)))
    paged.use_attention("per_row")
    rng = random.Random(0)
    rows = []
    for batch in args.batches:
        for context in [c for c in args.contexts if c > args.prefix]:
            tokens = [rng.randrange(1000, 30000) for _ in range(batch)]
            positions = [context] * batch
            views = partial(setattr, paged, "max_view_runs", MAX_VIEW_RUNS)
            cases = {
                "one_run": (partial(paged.decode, one_run[:batch], positions, tokens), views),
                "runs_views": (partial(paged.decode, shared[:batch], positions, tokens), views),
                "runs_gather": (
                    partial(paged.decode, shared[:batch], positions, tokens),
                    partial(setattr, paged, "max_view_runs", 1),
                ),
            }
            times = interleaved_medians(cases, args.repeats, loaded.device)
            row = {"batch": batch, "context": context, "prefix_tokens": args.prefix}
            row.update({f"{name}_step_s": times[name][0] for name in cases})
            row["views_vs_one_run"] = row["runs_views_step_s"] / row["one_run_step_s"]
            row["gather_vs_one_run"] = row["runs_gather_step_s"] / row["one_run_step_s"]
            rows.append(row)
            print(
                f"| {batch} | {context} | {row['one_run_step_s'] * 1e3:.2f} | "
                f"{row['runs_views_step_s'] * 1e3:.2f} ({row['views_vs_one_run']:.2f}x) | "
                f"{row['runs_gather_step_s'] * 1e3:.2f} ({row['gather_vs_one_run']:.2f}x) |",
                flush=True,
            )
    return rows


def _nothing() -> None:
    pass


def write_csv(name: str, rows: list[dict]) -> str:
    """`rows` as bench/results/`name` (paths.results_dir); the path as printed."""
    path = results_dir() / name
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return shown(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=64, help="fixed slots of 8192 positions")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--shape", choices=SHAPES, default="llama-124m")
    parser.add_argument("--dtype", default=default_dtype())
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8191])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefix", type=int, default=1024, help="shared system prompt tokens")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="capacity, decode, shared-capacity, shared-decode (default: all)",
    )
    args = parser.parse_args()

    if "capacity" in args.sections:
        print_capacity(args)
    if "decode" in args.sections:
        print(
            f"decode step, {args.shape} {args.dtype} on the CPU, {torch.get_num_threads()} threads"
        )
        steps = decode_times(args)
        print(f"wrote {write_csv('paged_decode-cpu.csv', steps)}")
    if "shared-capacity" in args.sections:
        print_shared_capacity(args)
    if "shared-decode" in args.sections:
        print(
            f"decode step behind a shared prefix of {args.prefix} tokens, {args.shape} "
            f"{args.dtype} on the CPU, {torch.get_num_threads()} threads (ms)"
        )
        print("| batch | context | one run | two runs, views | two runs, gathered |")
        print("|---:|---:|---:|---:|---:|")
        shared = shared_decode_times(args)
        print(f"wrote {write_csv('paged_decode_shared_prefix-cpu.csv', shared)}")


def print_shared_capacity(args: argparse.Namespace) -> None:
    rows = shared_capacity(args)
    print(
        f"every prompt behind one {args.prefix}-token system prompt, pool of "
        f"{rows[0]['pool_tokens']} positions"
    )
    print("| prompts | max_tokens | prefix in every sequence | shared once (min) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {args.prefix} + {r['distribution']} 256-8192 | {r['max_tokens']} | "
            f"{r['unshared_sequences']:.1f} | {r['shared_sequences']:.1f} ({r['shared_min']}) | "
            f"{r['ratio']:.2f}x |"
        )
    print(f"wrote {write_csv('paged_capacity_shared_prefix.csv', rows)}")


def print_capacity(args: argparse.Namespace) -> None:
    rows = capacity(args)
    shape = SHAPES["mistral-7b"]
    token_bytes = kv_token_bytes(
        shape["num_kv_heads"],
        shape["hidden_size"] // shape["num_heads"],
        torch.bfloat16,
        shape["num_layers"],
    )
    gib = rows[0]["pool_tokens"] * token_bytes / 2**30
    print(
        f"pool of {args.slots} slots x {MODEL_LEN} = {rows[0]['pool_tokens']} positions "
        f"({gib:.0f} GiB for mistral-7b bf16), blocks of {DEFAULT_BLOCK_SIZE}"
    )
    print("| prompts 256-8192 | max_tokens | fixed slots | paged (mean, min) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['distribution']} (mean {r['mean_prompt']:.0f}) | {r['max_tokens']} | "
            f"{r['fixed_slots']} | {r['paged_sequences']:.1f}, {r['paged_min']} | "
            f"{r['ratio']:.2f}x |"
        )
    print(f"wrote {write_csv('paged_capacity.csv', rows)}")


if __name__ == "__main__":
    main()
