"""Cold SSD reads of chunk KV per encoding: bytes on disk, read time of every layer of every chunk
(the loader's reads), and read + copy + dequantize on the target device.

    .venv/bin/python research/kv_codec.py                  # 4 chunks of a 7B-like shape, bf16, CPU
    .venv/bin/python research/kv_codec.py --device cuda

Writes bench/results/kv_codec-<device>.csv and prints the table (docs/kvstore.md, "Compressed KV").
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.paths import results_dir, shown  # noqa: E402
from kvstore import codec  # noqa: E402
from kvstore.codec import QuantizedPair  # noqa: E402
from kvstore.ssd_tier import SSDTier  # noqa: E402
from kvstore.types import ChunkKV, chunk_key  # noqa: E402

FINGERPRINT = "bench-kv-codec"
FIELDS = [
    "encoding",
    "dtype",
    "chunks",
    "bytes_read",
    "read_s",
    "read_gb_per_s",
    "read_speedup",
    "read_dequantize_s",
    "read_dequantize_speedup",
    "direct_io",
]


def read_all(tier: SSDTier, keys: list[str], device: torch.device | None) -> int:
    """Every layer of every entry, layer-major as the loader reads them; with a device, each
    layer is also copied there and dequantized. Returns the bytes read."""
    readers = [tier.open(key) for key in keys]
    assert all(r is not None for r in readers), "entry missing"
    nbytes = 0
    try:
        for layer in range(readers[0].num_layers):  # type: ignore[union-attr]
            for reader in readers:
                assert reader is not None
                pair = reader.read_layer(layer)
                nbytes += reader.header.layer_stride
                if device is None:
                    continue
                if isinstance(pair, QuantizedPair):
                    pair.to(device, non_blocking=True).dequantize()
                else:
                    tuple(t.to(device, non_blocking=True) for t in pair)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        for reader in readers:
            if reader is not None:
                reader.close()
    return nbytes


def timed(tier: SSDTier, keys: list[str], device: torch.device | None, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        tier.drop_page_cache()
        started = time.perf_counter()
        read_all(tier, keys, device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--store-dir", help="where the SSD tiers go (default: a temporary dir)")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    shape = (args.layers, args.kv_heads, args.tokens, args.head_dim)
    generator = torch.Generator().manual_seed(0)
    entries = {
        chunk_key(FINGERPRINT, [i]): ChunkKV(
            torch.randn(shape, generator=generator).to(dtype),
            torch.randn(shape, generator=generator).to(dtype),
        )
        for i in range(args.chunks)
    }
    keys = list(entries)
    root = Path(tempfile.mkdtemp(prefix="ragblend-kv-codec-", dir=args.store_dir))
    rows = []
    try:
        for encoding in codec.ENCODINGS:
            tier = SSDTier(root / encoding, 1 << 40, FINGERPRINT, encoding=encoding)
            for key, kv in entries.items():
                tier.put(key, kv)
            read_all(tier, keys, device)  # warm-up: allocator, CUDA context
            rows.append(
                {
                    "encoding": encoding,
                    "dtype": args.dtype,
                    "chunks": args.chunks,
                    "bytes_read": read_all(tier, keys, None),
                    "read_s": timed(tier, keys, None, args.repeats),
                    "read_dequantize_s": timed(tier, keys, device, args.repeats),
                    "direct_io": tier.direct_io,
                }
            )
    finally:
        shutil.rmtree(root)
    base = rows[0]
    for row in rows:
        row["read_gb_per_s"] = round(row["bytes_read"] / row["read_s"] / 1e9, 3)
        row["read_speedup"] = round(base["read_s"] / row["read_s"], 2)
        row["read_dequantize_speedup"] = round(
            base["read_dequantize_s"] / row["read_dequantize_s"], 2
        )
    path = args.csv or results_dir() / f"kv_codec-{device.type}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(
        f"\n{args.chunks} chunks of {list(shape)} {args.dtype}, cold reads, median of "
        f"{args.repeats}, dequantize on {device}\n"
    )
    print(
        "| encoding | MB read | read s | GB/s | speedup | read + dequantize s | speedup |\n"
        "|---|---|---|---|---|---|---|"
    )
    for row in rows:
        print(
            f"| {row['encoding']} | {row['bytes_read'] / 1e6:.1f} | {row['read_s']:.3f} "
            f"| {row['read_gb_per_s']:.2f} | {row['read_speedup']:.2f}x "
            f"| {row['read_dequantize_s']:.3f} | {row['read_dequantize_speedup']:.2f}x |"
        )
    print(f"\nwrote {shown(path)}")


if __name__ == "__main__":
    main()
