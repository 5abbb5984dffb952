"""Decode step time of the paged engine: one batched decode step against the number of sequences
(tokens/s, the ratio to batch 1), and the step at a short and a long context beside its
attention reads alone, the same reads over a contiguous slot per sequence (what the block table
replaced) and the per-token KV concatenation a growing cache would add. With `--cuda-graphs N`
(CUDA) each step is also replayed from CUDA graphs; with `--decode-attention PATH...` each way of
reading the KV blocks is timed in turn. The answers are the engine's defaults (the paged pool,
`decode_attention` auto, `cuda_graph_max_batch`); once parts 2 and 3 of bench/serving.py.

    .venv/bin/python research/serving_decode.py                   # CPU: llama-124m shape
    .venv/bin/python research/serving_decode.py --device cuda --cuda-graphs 64 --tag graphs

Writes bench/results/serving-[TAG-]DEVICE-decode.csv and -steps.csv (as bench/serving.py did)
and their tables as serving-[TAG-]DEVICE-decode.md (`--quick`: a seconds-long smoke run, files
tagged -quick).
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import shlex
import sys
from pathlib import Path

import _on_path  # noqa: F401  (bench/ on sys.path)
import torch
from harness import MODEL_HELP, SHAPES, build_store, default_dtype, median_seconds, workload_model
from paths import results_dir, shown
from serving_report import write_csv

from engine.engine import Engine
from engine.model.layers import LayerOps
from engine.runner.model_runner import pool_bytes
from engine.sched.blocks import BlockManager
from engine.types import DEFAULT_BLOCK_SIZE


def _decode_engine(loaded, store, num_seqs: int, model_len: int) -> Engine:
    """An engine whose pool holds exactly `num_seqs` sequences of `model_len` positions."""
    blocks = num_seqs * -(-model_len // DEFAULT_BLOCK_SIZE)
    need = pool_bytes(LayerOps(loaded.model), blocks * DEFAULT_BLOCK_SIZE)
    return Engine(loaded, store, max_num_seqs=num_seqs, max_model_len=model_len, kv_pool_bytes=need)


def block_tables(engine: Engine, batch: int) -> list[list[int]]:
    """The blocks of `batch` sequences of max_model_len, as the scheduler would reserve them."""
    pool = BlockManager(engine.runner.num_blocks, engine.runner.block_size)
    return [pool.allocate(b, engine.max_model_len) for b in range(batch)]


def decode_step_seconds(
    engine: Engine, batch: int, context: int, repeats: int
) -> tuple[float, float]:
    rng = random.Random(batch)
    tables, positions = block_tables(engine, batch), [context] * batch
    tokens = [rng.randrange(1000, 30000) for _ in range(batch)]
    seconds, spread, _ = median_seconds(
        lambda: engine.runner.decode(tables, positions, tokens), repeats, engine.device
    )
    return seconds, spread


def decode_throughput(loaded, store, args: argparse.Namespace, notes: list[str]) -> list[dict]:
    """One batched decode step per batch size, eager and (with `--cuda-graphs`) replayed from
    the CUDA graphs the engine captures per bucket, tokens/s and the ratio to batch 1 of the
    same variant."""
    engine = _decode_engine(loaded, store, max(args.decode_batches), args.decode_model_len)
    rows = []
    try:
        notes.append(
            f"decode: {engine.runner.num_blocks} blocks of {engine.runner.block_size} for "
            f"{max(args.decode_batches)} sequences x {engine.max_model_len} positions, "
            f"pool {2 * engine.runner.keys.nbytes / 2**30:.2f} GiB"
        )
        for replayed, path in decode_variants(args):
            engine.runner.use_attention(path)
            if replayed:
                engine.runner.use_cuda_graphs(args.cuda_graphs)
            variant = "graphs" if replayed else "eager"
            resolved = engine.runner.attention_path
            if len(args.decode_attention) > 1:
                variant += f" {path}" + (f" ({resolved})" if resolved != path else "")
            for batch in args.decode_batches:
                if batch > engine.scheduler.max_num_seqs:
                    print(f"skip batch {batch}: only {engine.scheduler.max_num_seqs} sequences fit")
                    continue
                seconds, spread = decode_step_seconds(
                    engine, batch, args.decode_context, args.decode_repeats
                )
                rows.append(
                    {
                        "step": variant,
                        "attention_path": resolved,
                        "batch": batch,
                        "context": args.decode_context,
                        "step_s": seconds,
                        "stdev_s": spread,
                        "tokens_per_s": batch / seconds,
                    }
                )
                print(
                    f"  {variant} decode batch {batch:3d}: {seconds * 1e3:8.2f} ms/step", flush=True
                )
    finally:
        engine.close()
        del engine
        gc.collect()
    for row in rows:
        first = next(r for r in rows if r["step"] == row["step"])
        row["vs_batch_1"] = row["tokens_per_s"] / first["tokens_per_s"]
    return rows


def decode_variants(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """(replayed from CUDA graphs, decode attention setting) pairs: every path eager, then
    (with `--cuda-graphs`) every path replayed."""
    paths = args.decode_attention
    return [(False, path) for path in paths] + [(True, path) for path in paths if args.cuda_graphs]


def attention_and_copy_seconds(
    engine: Engine, batch: int, context: int, repeats: int
) -> tuple[float, float, float]:
    """Seconds of the decode step's attention reads alone (every layer, the runner's own
    attention over the same blocks: `ModelRunner.reads` and `attention`), of one SDPA per layer
    over each row's context held contiguously (a slot per sequence, read as a view: what the
    block table replaced), and of one torch.cat of the context KV per layer (what a cache that
    grows by concatenation, as transformers' DynamicCache, adds to every token)."""
    runner = engine.runner
    shape = engine.ops.shape
    keys = runner.keys
    reads = runner.reads(block_tables(engine, batch), [context] * batch)
    q = torch.randn(
        batch,
        shape.num_kv_heads,
        runner.group,
        shape.head_dim,
        dtype=keys.dtype,
        device=keys.device,
    )
    new = torch.zeros(
        batch, shape.num_kv_heads, 1, shape.head_dim, dtype=keys.dtype, device=keys.device
    )
    # A contiguous [B, H_kv, T, D] cache, as a concatenating one holds: the copy it makes is
    # what it costs per token.
    context_keys = torch.zeros(
        batch, shape.num_kv_heads, context, shape.head_dim, dtype=keys.dtype, device=keys.device
    )
    context_values = torch.zeros_like(context_keys)

    @torch.inference_mode()
    def attention():
        for i in range(shape.num_layers):
            runner.attention(i, q, reads)

    @torch.inference_mode()
    def concatenate():
        for _ in range(shape.num_layers):
            torch.cat([context_keys, new], dim=2)
            torch.cat([context_values, new], dim=2)

    @torch.inference_mode()
    def slot_view():
        for _ in range(shape.num_layers):
            torch.nn.functional.scaled_dot_product_attention(q, context_keys, context_values)

    attn, _, _ = median_seconds(attention, repeats, engine.device)
    slot, _, _ = median_seconds(slot_view, repeats, engine.device)
    copy, _, _ = median_seconds(concatenate, repeats, engine.device)
    return attn, slot, copy


def step_time_vs_context(loaded, store, args: argparse.Namespace) -> list[dict]:
    engine = _decode_engine(loaded, store, max(args.step_batches), args.long_context + 1)
    rows = []
    try:
        for path in args.decode_attention:
            engine.runner.use_attention(path)
            path_rows = _step_rows(engine, args)
            if args.cuda_graphs:
                # Graphs captured anew per path: a replay runs the path it was captured with.
                engine.runner.use_cuda_graphs(args.cuda_graphs)
                for row in path_rows:
                    row["graphs_step_s"], _ = decode_step_seconds(
                        engine, row["batch"], row["context"], args.decode_repeats
                    )
                    print(
                        f"  graphs step batch {row['batch']:2d} context {row['context']:5d} "
                        f"({path}): {row['graphs_step_s'] * 1e3:8.2f} ms",
                        flush=True,
                    )
            rows += path_rows
    finally:
        engine.close()
        del engine
        gc.collect()
    return rows


def _step_rows(engine: Engine, args: argparse.Namespace) -> list[dict]:
    """Step time and attention reads at the short and the long context per step batch, the
    runner reading its blocks its current way (`attention_path`)."""
    rows = []
    path = engine.runner.attention_path
    for batch in args.step_batches:
        for context in (args.short_context, args.long_context):
            step, spread = decode_step_seconds(engine, batch, context, args.decode_repeats)
            attn, slot, copy = attention_and_copy_seconds(
                engine, batch, context, args.decode_repeats
            )
            rows.append(
                {
                    "attention_path": path,
                    "batch": batch,
                    "context": context,
                    "step_s": step,
                    "stdev_s": spread,
                    "attention_s": attn,
                    "slot_view_attention_s": slot,
                    "step_minus_attention_s": step - attn,
                    "kv_concat_s": copy,
                    "kv_bytes_read": 2
                    * engine.ops.shape.num_layers
                    * batch
                    * engine.ops.shape.num_kv_heads
                    * (context + 1)
                    * engine.ops.shape.head_dim
                    * engine.runner.keys.element_size(),
                }
            )
            print(
                f"  step batch {batch:2d} context {context:5d} ({path}): {step * 1e3:8.2f} ms, "
                f"attention {attn * 1e3:8.2f} ms (slot view {slot * 1e3:8.2f} ms), "
                f"concat {copy * 1e3:8.2f} ms",
                flush=True,
            )
    return rows


def tables(decode: list[dict], steps: list[dict]) -> list[str]:
    """Markdown lines of the decode throughput and the step time against context."""
    out = []
    if decode:
        out += [
            "",
            f"### Decode throughput, context {decode[0]['context']} tokens",
            "",
            "| step | concurrent sequences | step (ms) | tokens/s | vs batch 1 |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in decode:
            out.append(
                f"| {r['step']} | {r['batch']} | {r['step_s'] * 1e3:.2f} "
                f"| {r['tokens_per_s']:.1f} | {r['vs_batch_1']:.2f}x |"
            )
    if steps:
        graphs = "graphs_step_s" in steps[0]
        out += [
            "",
            "### Decode step time vs context",
            "",
            "| KV reads | batch | context | step (ms) | "
            + ("step from CUDA graphs (ms) | " if graphs else "")
            + "attention reads (ms) | slot view reads (ms) | step - attention (ms) "
            "| KV read (MiB) | a per-token KV concat would add (ms) |",
            "|---|---:|---:|---:|" + ("---:|" if graphs else "") + "---:|---:|---:|---:|---:|",
        ]
        for r in steps:
            out.append(
                f"| {r['attention_path']} | {r['batch']} | {r['context']} "
                f"| {r['step_s'] * 1e3:.2f} "
                + (f"| {r['graphs_step_s'] * 1e3:.2f} " if graphs else "")
                + f"| {r['attention_s'] * 1e3:.2f} | {r['slot_view_attention_s'] * 1e3:.2f} "
                f"| {r['step_minus_attention_s'] * 1e3:.2f} "
                f"| {r['kv_bytes_read'] / 2**20:.1f} | {r['kv_concat_s'] * 1e3:.2f} |"
            )
        out.append("")
        for reads, batch in sorted({(r["attention_path"], r["batch"]) for r in steps}):
            short, long = [r for r in steps if (r["attention_path"], r["batch"]) == (reads, batch)]
            out.append(
                f"- {reads}, batch {batch}: step {long['context']}/{short['context']} = "
                f"{long['step_s'] / short['step_s']:.2f}x; step grew "
                f"{(long['step_s'] - short['step_s']) * 1e3:.2f} ms, attention reads grew "
                f"{(long['attention_s'] - short['attention_s']) * 1e3:.2f} ms, the rest "
                f"(projections, MLP, LM head, mask) changed "
                f"{(long['step_minus_attention_s'] - short['step_minus_attention_s']) * 1e3:+.2f}"
                f" ms; a per-token concat of the {long['context']}-token KV would add "
                f"{long['kv_concat_s'] * 1e3:.2f} ms."
            )
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=default_dtype())
    parser.add_argument("--shape", choices=SHAPES, help="default: llama-124m, mistral-7b on cuda")
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--tag", help="results file tag (default: the --model's name)")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument(
        "--parts", nargs="+", default=["decode", "steps"], choices=["decode", "steps"]
    )
    # A request's prompt as bench/serving.py sends it: the decode context and the pool's length.
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--decode-batches", type=int, nargs="+")
    parser.add_argument(
        "--cuda-graphs",
        type=int,
        default=0,
        metavar="N",
        help="also replay each step of up to N rows from CUDA graphs (the engine's "
        "cuda_graph_max_batch), beside the eager step (default 0: eager only)",
    )
    parser.add_argument(
        "--decode-attention",
        nargs="+",
        default=["auto"],
        choices=["auto", "per_row", "batched", "flex"],
        help="how the step reads its KV blocks (the engine's decode_attention), each path "
        "measured in turn (default: auto, the device's)",
    )
    parser.add_argument("--decode-repeats", type=int)
    parser.add_argument("--step-batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--short-context", type=int)
    parser.add_argument("--long-context", type=int)
    args = parser.parse_args()
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU")
    if args.cuda_graphs < 0 or (args.cuda_graphs and not on_cuda):
        parser.error("--cuda-graphs is at least 0 and needs --device cuda")
    args.shape = args.shape or ("mistral-7b" if on_cuda else "llama-124m")
    defaults = dict(
        decode_batches=[1, 4, 16, 64],
        decode_repeats=10 if on_cuda else 5,
        short_context=1024,
        long_context=8191,
    )
    if args.quick:
        args.chunk_tokens = 64
        args.output_tokens = min(args.output_tokens, 8)
        defaults.update(
            decode_batches=[1, 4], decode_repeats=1, short_context=256, long_context=1023
        )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    prompt = args.chunks * args.chunk_tokens + args.question_tokens
    args.decode_context = prompt + 64  # about a request's context: prompt, template, output
    args.decode_model_len = 1 << math.ceil(math.log2(prompt + args.output_tokens + 128))
    return args


def main() -> None:
    args = parse_args()
    model = Path(args.model.rstrip("/")).name.lower() if args.model else args.shape
    label = args.tag or (model if args.model else None)
    tag = (f"{label}-" if label else "") + args.device + ("-quick" if args.quick else "")
    loaded = workload_model(args)
    store = build_store(loaded)
    notes: list[str] = []
    decode = decode_throughput(loaded, store, args, notes) if "decode" in args.parts else []
    steps = step_time_vs_context(loaded, store, args) if "steps" in args.parts else []
    device = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "CPU"
    report = [
        f"{args.model or f'{args.shape} (random init)'} {args.dtype} on {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads.",
        "",
        "```",
        "python research/serving_decode.py " + shlex.join(sys.argv[1:]),
        "```",
        "",
        *(f"- {n}" for n in notes),
        *tables(decode, steps),
    ]
    print("\n".join(report))
    results = results_dir()
    extra = {"device": args.device, "shape": model, "dtype": args.dtype}
    write_csv(results / f"serving-{tag}-decode.csv", decode, extra)
    write_csv(results / f"serving-{tag}-steps.csv", steps, extra)
    md = results / f"serving-{tag}-decode.md"
    md.write_text("\n".join(report) + "\n")
    print(f"wrote {shown(md)}")


if __name__ == "__main__":
    main()
