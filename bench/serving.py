"""Serving benchmark of the continuous-batching engine: TTFT and TPOT under Poisson load and past
the sustained rate.

One run, one loaded model (random init of a real shape) and one KV store shared by every engine.
Each request is 6 chunks x 512 tokens (or, with `--prompt-chunks`, a seeded draw of chunk counts)
from a pool of precomputed chunks (KV in the memory tier) plus a random 32-token question, and
decodes 32 tokens (ignore_eos). full_prefill and cacheblend (r = 0.15), each with the batching
scheduler (max_num_seqs 16) and with max_num_seqs = 1 (one sequence at a time). Each mode's
unloaded TTFT and TPOT are measured first (requests one at a time); the request rates are fractions
of 1 / unloaded TTFT (by default 0.05, 0.1, 0.2, 0.3 and 0.5 on the CPU, where batching sustains
less than 0.15; 0.3, 0.55, 0.8 and 1.05 on CUDA), then the `--overload-factors` times the highest
rate each (mode, scheduler) sustains with TTFT p50 <= 2x its unloaded TTFT. Arrivals are bounded by
a request count and a time limit; then the point waits until every admitted request has answered,
at most a generous cap; those still unanswered are cancelled and count with the TTFT they had
reached (a lower bound). Reports TTFT p50/p99, TPOT p50/p99, queue p50, tokens/s, completed,
refused (QueueFullError, the service's 429), the sustained rate, and the overload target at 1.5x:
every admitted request completes, TPOT p99 <= 3x an unloaded TPOT measured just before and after
that point, tokens/s >= the peak of the lower rates up to the 1.2x point's (that point and the
peak's rerun in turn, medians; the peak of every lower rate is shown beside it). The decode step
alone (throughput against batch, step time against context): research/serving_decode.py.

CPU default: llama-124m shape in bfloat16; `--device cuda`: mistral-7b shape. Writes
bench/results/serving-<device>[-summary|-timeline].csv,
bench/results/serving-<device>.md and docs/serving-<device>.png (`--quick`: a ~1-2 minute
smoke run with one overload point, files tagged -quick).
"""

from __future__ import annotations

import os

# A CPU shared with other processes: OpenMP threads that spin at every barrier stall behind
# the other processes' threads (small decode matmuls took 5x longer); passive waits do not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from harness import MODEL_HELP, SHAPES, build_store, default_dtype, synchronize, workload_model  # noqa: E402
from paths import plots_dir, results_dir, shown  # noqa: E402
from serving_load import serving  # noqa: E402
from serving_report import (  # noqa: E402
    markdown,
    plot,
    point_row,
    rebuild_from_csv,
    write_csv,
)
from serving_workload import MODES  # noqa: E402


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=default_dtype())
    parser.add_argument("--shape", choices=SHAPES, help="default: llama-124m, mistral-7b on cuda")
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--tag", help="results file tag (default: the --model's name)")
    parser.add_argument("--quick", action="store_true", help="a ~1 minute smoke run")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--modes", nargs="+", default=[m.value for m in MODES], choices=[m.value for m in MODES]
    )
    schedulers = ["batching", "one-at-a-time"]
    parser.add_argument("--schedulers", nargs="+", default=schedulers, choices=schedulers)
    parser.add_argument(
        "--from-csv",
        action="store_true",
        help="no run: rebuild the .md tables and the plot from this device's "
        "CSVs (after merging or editing points by hand)",
    )
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument(
        "--prompt-chunks",
        type=int,
        nargs="+",
        help="a prompt-length mix: each request draws its chunk count from these (seeded), "
        "e.g. 1 2 4 8 12 (default: every request --chunks chunks)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--pool-chunks", type=int, default=24)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="the engine's token budget per step (default: the engine's, by device)",
    )
    on_off = argparse.BooleanOptionalAction
    parser.add_argument("--cpu-prepacked-linear", action=on_off, help="default: the engine's")
    parser.add_argument(
        "--rate-fractions",
        type=float,
        nargs="+",
        help="rates as fractions of 1 / unloaded TTFT "
        "(default 0.05 0.1 0.2 0.3 0.5; on cuda 0.1 0.2 0.3 0.55 0.8: there full prefill on "
        "the paged engine with its step budget sustained less than 0.3)",
    )
    parser.add_argument(
        "--overload-factors",
        type=float,
        nargs="*",
        help="after the rate points, points at these factors x the sustained rate "
        "(default 1.2 1.5 2.0; none: no overload points)",
    )
    parser.add_argument(
        "--throughput-rounds",
        type=int,
        help="reruns of the overload target's point and the lower-rate peak, in turn (default 2)",
    )
    parser.add_argument("--requests", type=int, help="requests per point at most")
    parser.add_argument("--time-limit-s", type=float, help="arrivals per point stop after this")
    parser.add_argument(
        "--drain-s",
        type=float,
        help="then wait at most this long for every admitted answer (default: 10 s + 2 x the "
        "outstanding requests x the unloaded request time)",
    )
    parser.add_argument("--unloaded-requests", type=int)
    args = parser.parse_args()
    if args.device == "cuda" and not cuda and not args.from_csv:
        parser.error("--device cuda but torch sees no GPU")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        parser.error("--max-num-batched-tokens must be at least 1")
    on_cuda = args.device == "cuda"
    args.shape = args.shape or ("mistral-7b" if on_cuda else "llama-124m")
    defaults = dict(
        rate_fractions=[0.1, 0.2, 0.3, 0.55, 0.8] if on_cuda else [0.05, 0.1, 0.2, 0.3, 0.5],
        overload_factors=[1.2, 1.5, 2.0],
        requests=100 if on_cuda else 16,
        time_limit_s=30.0 if on_cuda else 50.0,
        unloaded_requests=5 if on_cuda else 3,
        # Requests sent at once to warm each engine before its unloaded figures (on a GPU the
        # first run of each shape pays for allocations), and requests alone before each point,
        # their median TPOT its baseline.
        warm_up=args.max_num_seqs if on_cuda else 0,
        baseline_requests=3,
        throughput_rounds=2,
    )
    if args.quick:
        args.chunk_tokens = 64
        args.pool_chunks = max(8, *(args.prompt_chunks or [0]))
        defaults.update(
            rate_fractions=[0.5],
            overload_factors=[1.5],
            requests=4,
            time_limit_s=4.0,
            unloaded_requests=1,
            warm_up=min(2, args.max_num_seqs),
            baseline_requests=1,
            throughput_rounds=1,
        )
        args.output_tokens = min(args.output_tokens, 8)
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    most = max(args.prompt_chunks or [args.chunks])
    if min(args.prompt_chunks or [args.chunks]) < 1 or most > args.pool_chunks:
        parser.error(f"chunk counts must be 1..--pool-chunks ({args.pool_chunks})")
    longest = most * args.chunk_tokens + args.question_tokens
    args.serving_model_len = 1 << math.ceil(math.log2(longest + args.output_tokens + 128))
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model.rstrip("/")).name.lower() if args.model else args.shape
    label = args.tag or (model if args.model else None)
    tag = (f"{label}-" if label else "") + args.device + ("-quick" if args.quick else "")
    if args.from_csv:
        rebuild_from_csv(tag)
        return
    started = time.perf_counter()
    loaded = workload_model(args)
    store = build_store(loaded)
    threads = torch.get_num_threads()
    notes: list[str] = []
    print("serving under Poisson load", flush=True)
    points, summary, timelines = serving(loaded, store, args, notes)
    synchronize(loaded.device)
    elapsed = time.perf_counter() - started
    device_name = (
        torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "CPU"
    )
    header = [
        f"{args.model or f'{args.shape} (random init)'} {args.dtype} on {device_name}, "
        f"torch {torch.__version__}, "
        f"{threads} torch threads; whole run {elapsed / 60:.1f} min.",
        "",
        "```",
        "python bench/serving.py " + shlex.join(sys.argv[1:]),
        "```",
        "",
        *[f"- {n}" for n in notes],
        f"- per point: at most {args.requests} requests and {args.time_limit_s:.0f} s of "
        f"arrivals, then until every admitted request has answered, at most "
        + (
            f"{args.drain_s:.0f} s"
            if args.drain_s is not None
            else "10 s + 2 x the outstanding requests x the unloaded request time"
        )
        + "; unanswered requests are cancelled and count in TTFT with the time they had "
        "waited (a lower bound). TPOT per request: (last token - first token) / (tokens - 1).",
        "- overload points at "
        + (" ".join(f"{f:g}x" for f in args.overload_factors) or "no factors")
        + " the sustained rate of each (mode, scheduler).",
        f"- batching: max_num_seqs {args.max_num_seqs}; one-at-a-time: max_num_seqs 1; "
        f"max_waiting {args.max_waiting}; cacheblend r = {args.ratio}.",
    ]
    report = markdown(points, summary, header)
    print()
    print(report)
    results = results_dir()
    extra = {"device": args.device, "shape": model, "dtype": args.dtype}
    write_csv(results / f"serving-{tag}.csv", [point_row(p) for p in points], extra)
    write_csv(results / f"serving-{tag}-summary.csv", summary, extra)
    write_csv(results / f"serving-{tag}-timeline.csv", timelines, extra)
    md = results / f"serving-{tag}.md"
    md.write_text(report)
    print(f"wrote {shown(md)}")
    if points:
        plot(
            points,
            summary,
            plots_dir() / f"serving-{tag}.png",
            f"{model} {args.dtype} on {device_name}: "
            f"{'/'.join(map(str, args.prompt_chunks or [args.chunks]))}x{args.chunk_tokens}-"
            f"token chunks + {args.question_tokens}-token question, {args.output_tokens} out",
        )


if __name__ == "__main__":
    main()
