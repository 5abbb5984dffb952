"""Parts 2 and 3 of bench/serving.py: batched decode throughput against the number of sequences,
and decode step time against context length beside its attention reads alone; with
`--cuda-graphs`, each step also replayed from CUDA graphs, side by side with the eager step; each
of `--decode-attention`'s paths in turn (the engine's ways of reading the KV blocks)."""

from __future__ import annotations

import argparse
import gc
import random

import torch
from harness import median_seconds

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
