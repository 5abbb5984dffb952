"""Part 1 of bench/serving.py: TTFT and TPOT of the engine under Poisson load, per mode and
scheduler, the highest rate each sustains (TTFT p50 <= 2x unloaded) and overload points past it."""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import statistics
import time
from dataclasses import asdict

from serving_overload import TARGET_FACTOR, overload_rates, rerun_points, target_row, target_text
from serving_point import Config, Outcome, Point, Unloaded, one_request, run_point, summarise
from serving_workload import MODES, Workload, build_workload, request_for

from engine.engine import Engine
from engine.types import Mode


def warm_up(engine: Engine, workload: Workload, mode: Mode, args: argparse.Namespace) -> None:
    """`args.warm_up` requests sent at once, so that the steps of a batch (decodes of many rows,
    prefills side by side and in pieces) have run before anything is timed: on a GPU the first
    run of each shape pays for allocations and kernel plans."""
    request = request_for(mode, args)
    layouts = workload.layouts[: min(args.warm_up, engine.scheduler.max_num_seqs)]

    async def burst() -> None:
        await asyncio.gather(
            *(
                one_request(engine, request, layout, Outcome(arrival_s=time.perf_counter()))
                for layout in layouts
            )
        )

    asyncio.run(burst())


def measure_unloaded(
    engine: Engine, workload: Workload, mode: Mode, args: argparse.Namespace
) -> Unloaded:
    """Medians of requests sent one at a time (after one warm-up), streamed as under load."""
    request = request_for(mode, args)
    if args.warm_up:
        warm_up(engine, workload, mode, args)
    outcomes = []
    for layout in workload.unloaded:
        outcome = Outcome(arrival_s=time.perf_counter())
        asyncio.run(one_request(engine, request, layout, outcome))
        if outcome.result is None:
            raise RuntimeError(f"unloaded {mode.value} request failed: {outcome.error}")
        outcomes.append(outcome)
    results = sorted((o.result for o in outcomes[1:] if o.result), key=lambda r: r.timings.ttft_s)
    measured = [r.timings for r in results]
    tpots = [t for o in outcomes[1:] if (t := o.tpot_s()) is not None]

    def median(field: str) -> float:
        return statistics.median(getattr(t, field) for t in measured)

    return Unloaded(
        ttft_s=median("ttft_s"),
        request_s=median("total_s"),
        tpot_s=statistics.median(tpots) if tpots else math.nan,
        queue_s=median("queue_s"),
        prefill_s=median("prefill_s"),
        kv_wait_s=median("kv_wait_s"),
        recompute_s=median("recompute_s"),
        layers=results[len(results) // 2].layers,
    )


def alone_tpots(
    engine: Engine, workload: Workload, mode: Mode, args: argparse.Namespace
) -> list[float]:
    """The TPOTs of `args.baseline_requests` requests alone on a warm engine. A point's baseline
    is their median right before and right after it: the machine's speed drifts over a run,
    and the point's figures are read against the speed around them."""
    tpots = []
    for _ in range(args.baseline_requests):
        outcome = Outcome(arrival_s=time.perf_counter())
        request = request_for(mode, args)
        asyncio.run(one_request(engine, request, workload.unloaded[1], outcome))
        if (tpot := outcome.tpot_s()) is not None:
            tpots.append(tpot)
    return tpots


def sustained_rate(points: list[Point], unloaded_s: float) -> tuple[float, str]:
    """The highest rate with TTFT p50 <= 2x unloaded, interpolated linearly (in rate) between
    the last passing point and the first failing one; '>=' when every point passes."""
    points = sorted(points, key=lambda p: p.rate)
    limit = 2 * unloaded_s
    last = None
    for p in points:
        if not p.sustained:
            if last is None:
                return points[0].rate, "<"
            if p.ttft_p50_s <= limit:  # failed on refusals only
                return last.rate, "="
            span = (limit - last.ttft_p50_s) / (p.ttft_p50_s - last.ttft_p50_s)
            return last.rate + span * (p.rate - last.rate), "~"
        last = p
    return points[-1].rate, ">="


def measure_point(
    config: Config,
    workload: Workload,
    args: argparse.Namespace,
    rate: float,
    factor: float = math.nan,
) -> Point:
    unloaded_ttft = config.unloaded.ttft_s
    before = alone_tpots(config.engine, workload, config.mode, args)
    point = Point(
        config.mode.value,
        config.scheduler,
        config.max_num_seqs,
        rate * unloaded_ttft,
        rate,
        overload_factor=factor,
    )
    outcomes, elapsed, drain = asyncio.run(run_point(config, workload, args, rate))
    around = before + alone_tpots(config.engine, workload, config.mode, args)
    summarise(point, outcomes, elapsed, unloaded_ttft)
    point.drain_s, point.unloaded_tpot_s = drain, statistics.median(around or [math.nan])
    if config.decode_batches:
        point.mean_decode_batch = statistics.mean(config.decode_batches)
    label = f"{factor:.2f}x sust" if not math.isnan(factor) else f"{point.rate_fraction:.2f}x 1/T"
    print(
        f"  {point.mode:<13}{point.scheduler:<14}{rate:7.3f}/s {label}  sent {point.sent:3d} "
        f"done {point.completed:3d} refused {point.refused:2d} left {point.unfinished:2d}  "
        f"TTFT p50 {point.ttft_p50_s:7.3f} p99 {point.ttft_p99_s:7.3f}  "
        f"TPOT p50 {point.tpot_p50_s:6.3f} p99 {point.tpot_p99_s:6.3f}  "
        f"{point.tokens_per_s:6.1f} tok/s (alone TPOT {point.unloaded_tpot_s:.3f})  "
        f"{elapsed:5.1f} s (drain {drain:4.1f})",
        flush=True,
    )
    return point


def rerun_throughput(
    config: Config, workload: Workload, args: argparse.Namespace, points: list[Point]
) -> list[Point]:
    """The overload target's point and the lower-rate peaks it is compared with, rerun in turn
    `--throughput-rounds` times: their throughputs are compared by medians over the runs."""
    compared = rerun_points(points)
    reruns = []
    for round_ in range(1, args.throughput_rounds + 1):
        for point in compared:
            rerun = measure_point(config, workload, args, point.rate, point.overload_factor)
            rerun.rate_fraction, rerun.rerun = point.rate_fraction, round_
            reruns.append(rerun)
    return reruns


def engine_options(args: argparse.Namespace, max_num_seqs: int) -> dict:
    options = dict(
        max_num_seqs=max_num_seqs,
        max_model_len=args.serving_model_len,
        max_waiting=args.max_waiting,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.cpu_prepacked_linear is not None:  # None: the engine's default
        options["cpu_prepacked_linear"] = args.cpu_prepacked_linear
    return options


def serving(
    loaded, store, args: argparse.Namespace, notes: list[str]
) -> tuple[list[Point], list[dict], list[dict]]:
    """The points of every (scheduler, mode), a summary row each, and the layer timeline of
    each mode's unloaded request of median TTFT (when each layer's KV was loaded and computed,
    seconds since its prefill started)."""
    schedulers = [("batching", args.max_num_seqs), ("one-at-a-time", 1)]
    schedulers = [s for s in schedulers if s[0] in args.schedulers]
    points: list[Point] = []
    summary: list[dict] = []
    unloaded: dict[Mode, Unloaded] = {}
    workload = None
    for scheduler, max_num_seqs in schedulers:
        for mode in [m for m in MODES if m.value in args.modes]:
            engine = Engine(loaded, store, **engine_options(args, max_num_seqs))
            try:
                if workload is None:
                    workload = build_workload(engine, args, args.requests + 32)
                    budget = engine.scheduler.max_num_batched_tokens
                    notes += [
                        f"{workload.describe(args)}, {args.output_tokens} output tokens; KV "
                        f"pool {engine.runner.num_blocks} blocks x {engine.runner.block_size}, "
                        f"max_model_len {engine.max_model_len}",
                        f"max_num_batched_tokens: {budget}"
                        + (" (--max-num-batched-tokens)" if args.max_num_batched_tokens else "")
                        + f", a decode counting {engine.scheduler.decode_weight}",
                        f"overload baselines: the median TPOT of {args.baseline_requests} "
                        "request(s) alone right before and right after each point",
                    ]
                if mode not in unloaded:
                    unloaded[mode] = measure_unloaded(engine, workload, mode, args)
                    u = unloaded[mode]
                    print(
                        f"unloaded {mode.value}: TTFT {u.ttft_s:.3f} s, TPOT {u.tpot_s:.4f} s, "
                        f"request {u.request_s:.3f} s; TTFT: {u.split()}"
                    )
                else:
                    engine.generate(request_for(mode, args), layout=workload.unloaded[0])
                config = Config(engine, mode, scheduler, max_num_seqs, unloaded[mode])
                engine.add_step_listener(config.record_step)
                config_points = [
                    measure_point(config, workload, args, f / config.unloaded.ttft_s)
                    for f in args.rate_fractions
                ]
                rate, how = sustained_rate(config_points, config.unloaded.ttft_s)
                config_points += [
                    measure_point(config, workload, args, at, factor)
                    for factor, at in overload_rates(rate, args.overload_factors)
                ]
                config_points += rerun_throughput(config, workload, args, config_points)
                points += config_points
                summary.append(
                    {
                        "mode": mode.value,
                        "scheduler": scheduler,
                        "max_num_seqs": max_num_seqs,
                        "unloaded_ttft_s": config.unloaded.ttft_s,
                        "unloaded_request_s": config.unloaded.request_s,
                        "sustained_rate": rate,
                        "sustained_how": how,
                        "unloaded_tpot_s": config.unloaded.tpot_s,
                        "unloaded_queue_s": config.unloaded.queue_s,
                        "unloaded_prefill_s": config.unloaded.prefill_s,
                        "unloaded_kv_wait_s": config.unloaded.kv_wait_s,
                        "unloaded_recompute_s": config.unloaded.recompute_s,
                    }
                )
                if (row := target_row(config_points, summary[-1])) is not None:
                    print(f"  overload target at {TARGET_FACTOR}x: {target_text(row)}")
            finally:
                engine.close()
                del engine
                gc.collect()
    timelines = [
        {"mode": mode.value, **asdict(layer)} for mode, u in unloaded.items() for layer in u.layers
    ]
    return points, summary, timelines
