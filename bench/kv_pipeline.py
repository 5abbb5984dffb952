"""Pipelined KV loading side by side in one run: full prefill, cacheblend from the memory
tier, from a cold SSD tier, load-only and compute-only, the measured overlap, and the
controller on each tier (plus an emulated slow tier that it must refuse to wait on).

Writes bench/results/kv_pipeline-<device>.csv and docs/kv_pipeline-<device>.png.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from harness import (  # noqa: E402
    add_workload_arguments,
    build_engine,
    build_model,
    median_seconds,
    random_layout,
    store_chunks,
)

from engine.types import Mode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--store-dir", help="SSD tier directory (default: a temporary one)")
    args = parser.parse_args()

    loaded = build_model(args.shape, args.device, args.dtype)
    device = loaded.device
    memory = build_engine(loaded)
    layout = random_layout(memory, args.chunks, args.chunk_tokens, args.question_tokens)
    store_chunks(memory, layout)
    store_dir = Path(args.store_dir or tempfile.mkdtemp(prefix="ragblend-kv-"))
    ssd = build_engine(loaded, memory_budget_bytes=0, ssd_path=str(store_dir / "ssd"))
    store_chunks(ssd, layout)
    keys = [ssd.chunk_key(tokens) for tokens in layout.chunks]
    cold = ssd.store.drop_page_cache

    def ttft(engine, mode, ratio):
        def run():
            prefill = engine.prefill_layout(layout, mode, ratio)
            int(prefill.output.logits.argmax())
            return prefill

        return run

    def load_only():
        with ssd.store.open_stream(keys, device=device) as stream:
            for i in range(loaded.model.config.num_hidden_layers):
                stream.layer(i)

    rows = []

    def measure(name, tier, run, before=lambda: None):
        seconds, spread, prefill = median_seconds(run, args.repeats, device, before)
        row = {"case": name, "tier": tier, "ttft_s": seconds, "stdev_s": spread}
        if prefill is not None:
            chunk_tokens = sum(len(c) for c in layout.chunks)
            row["recompute_ratio"] = prefill.usage.recomputed_tokens / chunk_tokens
            row["overlap"] = prefill.overlap
            row["kv_load_s"] = prefill.kv_load_s
        rows.append(row)
        return seconds

    full = measure("full_prefill", "-", ttft(memory, Mode.FULL_PREFILL, None))
    compute_only = measure("cacheblend", "memory", ttft(memory, Mode.CACHEBLEND, args.ratio))
    pipelined = measure("cacheblend", "ssd (cold)", ttft(ssd, Mode.CACHEBLEND, args.ratio), cold)
    load = measure("load only", "ssd (cold)", load_only, cold)
    measure("controller", "memory", ttft(memory, Mode.CACHEBLEND, None))
    controlled_ssd = measure("controller", "ssd (cold)", ttft(ssd, Mode.CACHEBLEND, None), cold)

    # A tier slower than recompute: each layer takes 1.5x a full layer's compute to load.
    delay = 1.5 * full / loaded.model.config.num_hidden_layers
    slow = build_engine(
        loaded, memory_budget_bytes=0, ssd_path=str(store_dir / "ssd"), kv_read_delay_s=delay
    )
    measure("cacheblend", "slow tier", ttft(slow, Mode.CACHEBLEND, args.ratio), cold)
    controlled_slow = measure("controller", "slow tier", ttft(slow, Mode.CACHEBLEND, None), cold)

    for row in rows:
        row["vs_full_prefill"] = row["ttft_s"] / full
    print(
        f"\n{args.shape} {args.dtype} on {args.device}: {layout.num_tokens} prompt tokens, "
        f"KV {sum(len(c) for c in layout.chunks)} chunk tokens, median of {args.repeats}"
    )
    header = f"{'case':<14}{'tier':<12}{'TTFT s':>9}{'vs full':>9}{'recomp':>8}{'overlap':>9}"
    print(header)
    for row in rows:
        print(
            f"{row['case']:<14}{row['tier']:<12}{row['ttft_s']:>9.4f}"
            f"{row['vs_full_prefill']:>9.3f}{row.get('recompute_ratio', float('nan')):>8.2f}"
            f"{row.get('overlap', float('nan')):>9.2f}"
        )
    checks = {
        "memory tier TTFT <= 0.35 x full prefill": compute_only <= 0.35 * full,
        "pipelined TTFT <= 1.15 x max(load-only, compute-only)": pipelined
        <= 1.15 * max(load, compute_only),
        "controller <= 1.05 x full prefill (memory, ssd, slow tier)": max(
            rows[4]["ttft_s"], controlled_ssd, controlled_slow
        )
        <= 1.05 * full,
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'MISS'}  {name}")

    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    out = ROOT / "bench" / "results" / f"kv_pipeline-{args.device}.csv"
    fields = [
        "case",
        "tier",
        "ttft_s",
        "stdev_s",
        "vs_full_prefill",
        "recompute_ratio",
        "overlap",
        "kv_load_s",
    ]
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(
        rows,
        ROOT / "docs" / f"kv_pipeline-{args.device}.png",
        f"{args.shape} {args.dtype} on {args.device}, {layout.num_tokens} tokens",
    )
    print(f"wrote {out}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    labels = [f"{r['case']}\n{r['tier']}" for r in rows]
    colors = [
        "#777"
        if r["case"] == "full_prefill"
        else "#c84"
        if r["case"] == "load only"
        else "#48c"
        if r["case"] == "cacheblend"
        else "#4a4"
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar(range(len(rows)), [r["ttft_s"] for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"TTFT by mode and KV tier — {title}")
    ax.axhline(rows[0]["ttft_s"], color="#777", linestyle="--", linewidth=1)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
