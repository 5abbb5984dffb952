"""Pipelined KV loading side by side in one run: full prefill, then cacheblend, load-only and
the controller from each tier (gpu on CUDA, host memory, a cold SSD tier uncompressed and
compressed), the measured overlap, the effective load rate and host-to-device copies per layer,
and an emulated slow tier that the controller must refuse to wait on.

Writes bench/results/kv_pipeline-<device>.csv and docs/kv_pipeline-<device>.png (with
`--model`, a real checkpoint: kv_pipeline-<tag>-<device>.*, the tag its name by default).
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
    interleaved_medians,
    median_seconds,
    model_label,
    random_layout,
    results_name,
    store_chunks,
    workload_model,
)
from paths import plots_dir, results_dir, shown  # noqa: E402

from engine.blend.dense import run_to_end
from engine.blend.prefill import (
    Prefill,  # noqa: E402
    PrefillAsk,
)
from engine.types import Mode  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--store-dir", help="SSD tier directory (default: a temporary one)")
    parser.add_argument(
        "--encoding",
        default="int8",
        help="compressed SSD rows: the encoding to compare with the uncompressed SSD tier",
    )
    args = parser.parse_args()

    loaded = workload_model(args)
    device = loaded.device
    num_layers = loaded.model.config.num_hidden_layers
    memory = build_engine(loaded)
    layout = random_layout(memory, args.chunks, args.chunk_tokens, args.question_tokens)
    store_chunks(memory, layout)
    store_dir = Path(args.store_dir or tempfile.mkdtemp(prefix="ragblend-kv-"))
    ssd = build_engine(loaded, memory_budget_bytes=0, ssd_path=str(store_dir / "ssd"))
    store_chunks(ssd, layout)
    packed = build_engine(
        loaded,
        memory_budget_bytes=0,
        ssd_path=str(store_dir / f"ssd-{args.encoding}"),
        ssd_encoding=args.encoding,
    )
    store_chunks(packed, layout)
    gpu = None
    if device.type == "cuda":
        gpu = build_engine(loaded, memory_budget_bytes=0, gpu_budget_bytes=64 * 1024**3)
        store_chunks(gpu, layout, fastest_tier=True)
    keys = [memory.chunk_key(tokens) for tokens in layout.chunks]
    ssd_tier, packed_tier = "ssd (cold)", f"ssd {args.encoding} (cold)"

    def cold():
        ssd.store.drop_page_cache()
        packed.store.drop_page_cache()

    def ttft(engine, mode, ratio):
        def run():
            prefill = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(mode, ratio)))
            int(prefill.output.logits.argmax())
            return prefill

        return run

    def load_only(engine):
        def run():
            with engine.store.open_stream(keys, device=device) as stream:
                for i in range(num_layers):
                    stream.layer(i)
            return stream

        return run

    def nothing():
        return None

    # A tier slower than recompute: each layer takes 1.5x a full layer's compute to load
    # (a full prefill timed once here, before the round-robin).
    full_once = median_seconds(ttft(memory, Mode.FULL_PREFILL, None), 1, device)[0]
    slow = build_engine(
        loaded,
        memory_budget_bytes=0,
        ssd_path=str(store_dir / "ssd"),
        kv_read_delay_s=1.5 * full_once / num_layers,
    )
    tiers_run = [("memory", memory, nothing), (ssd_tier, ssd, cold), (packed_tier, packed, cold)]
    if gpu is not None:
        tiers_run.insert(0, ("gpu", gpu, nothing))
    cases = {("full_prefill", "-"): (ttft(memory, Mode.FULL_PREFILL, None), nothing)}
    for tier, engine, before in tiers_run:
        cases[("cacheblend", tier)] = (ttft(engine, Mode.CACHEBLEND, args.ratio), before)
        cases[("load only", tier)] = (load_only(engine), before)
        cases[("controller", tier)] = (ttft(engine, Mode.CACHEBLEND, None), before)
    cases[("cacheblend", "slow tier")] = (ttft(slow, Mode.CACHEBLEND, args.ratio), cold)
    cases[("controller", "slow tier")] = (ttft(slow, Mode.CACHEBLEND, None), cold)
    order = ["full_prefill", "cacheblend", "load only", "controller"]
    try:
        measured = interleaved_medians(cases, args.repeats, device)
    finally:
        for engine in [memory, ssd, packed, slow, *([gpu] if gpu is not None else [])]:
            engine.close()

    rows: list[dict] = []
    for name, tier in sorted(cases, key=lambda c: order.index(c[0])):
        seconds, spread, result = measured[(name, tier)]
        row = {"case": name, "tier": tier, "ttft_s": seconds, "stdev_s": spread}
        if isinstance(result, Prefill):
            chunk_tokens = sum(len(c) for c in layout.chunks)
            row["recompute_ratio"] = result.usage.recomputed_tokens / chunk_tokens
            row["overlap"] = result.overlap
            row["kv_load_s"] = result.kv_load_s
        elif result is not None:  # a load-only stream: what it moved, how fast
            row["load_gb_s"] = sum(result.stats.bytes_by_tier.values()) / seconds / 1e9
            row["device_copies_per_layer"] = result.stats.device_copies / num_layers
        rows.append(row)
    full = rows_of(rows, "full_prefill", "-")["ttft_s"]
    blended = {r["tier"]: r["ttft_s"] for r in rows if r["case"] == "cacheblend"}
    loads = {r["tier"]: r["ttft_s"] for r in rows if r["case"] == "load only"}
    controlled = {r["tier"]: r["ttft_s"] for r in rows if r["case"] == "controller"}

    for row in rows:
        row["vs_full_prefill"] = row["ttft_s"] / full
    print(
        f"\n{model_label(args)} {args.dtype} on {args.device}: {layout.num_tokens} prompt tokens, "
        f"KV {sum(len(c) for c in layout.chunks)} chunk tokens, median of {args.repeats} rounds"
    )
    print(
        f"{'case':<14}{'tier':<18}{'TTFT s':>9}{'vs full':>9}{'recomp':>8}{'overlap':>9}"
        f"{'GB/s':>9}{'copies/layer':>14}"
    )
    for row in rows:
        print(
            f"{row['case']:<14}{row['tier']:<18}{row['ttft_s']:>9.4f}"
            f"{row['vs_full_prefill']:>9.3f}{row.get('recompute_ratio', float('nan')):>8.2f}"
            f"{row.get('overlap', float('nan')):>9.2f}{row.get('load_gb_s', float('nan')):>9.2f}"
            f"{row.get('device_copies_per_layer', float('nan')):>14.1f}"
        )
    worst = max(controlled.values())
    checks = {
        "controller <= 1.05 x full prefill on every tier": worst <= 1.05 * full,
        f"{args.encoding} SSD loads >= 1.8 x faster than uncompressed SSD": loads[ssd_tier]
        >= 1.8 * loads[packed_tier],
    }
    if device.type == "cuda":
        checks |= {
            "host-memory tier <= 0.25 x full prefill": blended["memory"] <= 0.25 * full,
            "gpu tier <= 0.22 x full prefill": blended["gpu"] <= 0.22 * full,
            "effective host-to-device >= 40 GB/s": rows_of(rows, "load only", "memory")["load_gb_s"]
            >= 40,
        }
    else:
        checks |= {
            "memory tier <= 0.35 x full prefill": blended["memory"] <= 0.35 * full,
            "pipelined SSD <= 1.15 x max(load-only, compute-only)": blended[ssd_tier]
            <= 1.15 * max(loads[ssd_tier], blended["memory"]),
        }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'MISS'}  {name}")

    out = results_dir() / results_name(args, "kv_pipeline")
    fields = [
        "case",
        "tier",
        "ttft_s",
        "stdev_s",
        "vs_full_prefill",
        "recompute_ratio",
        "overlap",
        "kv_load_s",
        "load_gb_s",
        "device_copies_per_layer",
    ]
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    png = plots_dir() / results_name(args, "kv_pipeline", "png")
    title = f"{model_label(args)} {args.dtype} on {args.device}, {layout.num_tokens} tokens"
    plot(rows, png, title)
    print(f"wrote {shown(out)} and {shown(png)}")


def rows_of(rows: list[dict], case: str, tier: str) -> dict:
    return next(r for r in rows if r["case"] == case and r["tier"] == tier)


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
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
