"""Smoke run of the product benchmarks (bench/): each script in a subprocess with the smallest
arguments that still take its whole code path on the CPU, its files written to a scratch folder.
research/smoke.py runs the experiments' cases the same way.

    .venv/bin/python bench/smoke.py                        # every case below, ~3 min on 2 cores
    .venv/bin/python bench/smoke.py serving kv_pipeline    # those cases only

A case passes when each of its runs exits 0 and its folder (RAGBLEND_BENCH_OUT, bench/paths.py)
then holds a CSV with at least one row, and fails when a file in bench/results/ or a plot in
docs/ changed while it ran. Prints a table (bench, seconds, status) and the stderr tail of every
failed case, and exits 1 naming them. `make bench-smoke` runs it (then research/smoke.py); CI,
after `make test`.

Covered beyond each script's own code: layer_profile.py (engine_ttft --profile), harness.py,
and serving.py's modules (serving_load, _overload, _point, _report, _workload; the report once
more from the CSVs, --from-csv), quality_real_report.py (quality_real.py on the
packaged SmolLM2, and --from-csv).

Not covered:
- scale.py: engines, a gateway and Redis as processes, 20 s of load per engine count.
- load.py: a load generator against a running stack (`--url`).
- retriever_bench.py: the retriever's, not the engine's; MiniLM embeds hundreds of texts before
  anything is measured (~65 s at its smallest on 2 busy cores).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from paths import COMMITTED_PLOTS, COMMITTED_RESULTS, OUT_ENV, ROOT

# A case takes ~2-40 s on 2 cores; the limit only stops a hung benchmark.
RUN_TIMEOUT_S = 300.0
STDERR_TAIL_LINES = 30

MODEL = "--device cpu --shape llama-124m"
SERVING = (
    f"{MODEL} --quick --chunks 2 --requests 2 --time-limit-s 1 --output-tokens 4 --max-num-seqs 4"
)

QUALITY = (
    "--prompts 1 --chunk-tokens 32 --chunks-per-prompt 2 --answer-tokens 2 --ratios 0.15 "
    "--check-layers 1 --curves 1 --selections hkvd random --coverages 0.9 --threads 1"
)


@dataclass(frozen=True)
class Case:
    """A benchmark's smoke: its script's runs in order (each one's arguments as on a command
    line), all writing into one folder."""

    name: str
    runs: tuple[str, ...]
    folder: str = "bench"  # or research: an experiment whose answer became a default

    @property
    def script(self) -> str:
        return f"{self.folder}/{self.name}.py"


@dataclass(frozen=True)
class Outcome:
    name: str
    seconds: float
    status: str  # "ok", or why the case failed
    command: str = ""  # the run that failed, as a command line
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


CASES = (
    Case(
        "engine_ttft",
        (
            f"{MODEL} --chunks 2 --chunk-tokens 64 --question-tokens 8 --repeats 1 "
            "--ratios 0.15 0.5 --profile",
        ),
    ),
    Case("prefill_launches", ("--chunks 2 4 --chunk-tokens 32",)),
    Case(
        "served_ttft",
        (f"{MODEL} --chunks 2 --chunk-tokens 64 --question-tokens 8 --repeats 1",),
    ),
    Case(
        "kv_pipeline",
        (f"{MODEL} --chunks 2 --chunk-tokens 64 --question-tokens 8 --repeats 1",),
    ),
    Case("serving", (SERVING, f"{SERVING} --from-csv")),
    # The packaged SmolLM2 on one short prompt: HKVD and random at one ratio and one coverage.
    Case("quality_real", (QUALITY, f"{QUALITY} --from-csv")),
)


def committed_files() -> dict[Path, int]:
    """What the benchmarks write by default, with modification times: bench/results/ and the
    plots in docs/ (not its .md files, which may be edited by hand during a run)."""
    paths = [*COMMITTED_RESULTS.iterdir(), *COMMITTED_PLOTS.glob("*.png")]
    return {path: path.stat().st_mtime_ns for path in paths if path.is_file()}


def changed(before: dict[Path, int], after: dict[Path, int]) -> list[str]:
    paths = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    return sorted(str(p.relative_to(ROOT)) for p in paths)


def tail(text: str | bytes | None) -> str:
    # TimeoutExpired holds what the process wrote as bytes, even when run with text=True.
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-STDERR_TAIL_LINES:])


def has_rows(folder: Path) -> bool:
    """Whether a CSV in `folder` holds a header and at least one row."""
    for path in folder.glob("*.csv"):
        with path.open() as f:
            if sum(1 for line in f if line.strip()) >= 2:
                return True
    return False


def failure(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit {returncode}"


def run_case(case: Case, folder: Path) -> Outcome:
    folder.mkdir()
    env = {**os.environ, OUT_ENV: str(folder)}
    before = committed_files()
    started = time.perf_counter()
    for number, run in enumerate(case.runs, 1):
        command = [sys.executable, str(ROOT / case.script), *shlex.split(run)]
        which = f"run {number}/{len(case.runs)}: " if len(case.runs) > 1 else ""
        line = f"python {case.script} {run}"
        try:
            done = subprocess.run(
                command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as timeout:
            status = f"{which}timed out after {RUN_TIMEOUT_S:.0f} s"
            seconds = time.perf_counter() - started
            return Outcome(case.name, seconds, status, line, tail(timeout.stderr))
        if done.returncode:
            status = f"{which}{failure(done.returncode)}"
            seconds = time.perf_counter() - started
            return Outcome(case.name, seconds, status, line, tail(done.stderr))
    seconds = time.perf_counter() - started
    if touched := changed(before, committed_files()):
        return Outcome(case.name, seconds, f"wrote outside its folder: {', '.join(touched)}")
    if not has_rows(folder):
        return Outcome(case.name, seconds, "no CSV with a row")
    return Outcome(case.name, seconds, "ok")


def parse_args(cases: tuple[Case, ...], doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    known = [case.name for case in cases]
    parser.add_argument("names", nargs="*", help=f"cases to run (default: all): {', '.join(known)}")
    args = parser.parse_args()
    # Not argparse's choices: with nargs="*" they refuse the empty default.
    if unknown := [name for name in args.names if name not in known]:
        parser.error(f"unknown cases {unknown}; the cases: {', '.join(known)}")
    return args


def main(known: tuple[Case, ...], doc: str) -> int:
    """Runs the cases of `known` that the command line names (all without names)."""
    args = parse_args(known, doc)
    cases = [case for case in known if not args.names or case.name in args.names]
    started = time.perf_counter()
    outcomes = []
    width = max(len(case.name) for case in known) + 2
    with tempfile.TemporaryDirectory(prefix="ragblend-bench-smoke-") as scratch:
        print(f"{'bench':<{width}}{'seconds':>9}  status", flush=True)
        for case in cases:
            outcome = run_case(case, Path(scratch) / case.name)
            outcomes.append(outcome)
            print(f"{outcome.name:<{width}}{outcome.seconds:>9.1f}  {outcome.status}", flush=True)
    print(f"{'total':<{width}}{time.perf_counter() - started:>9.1f}")
    failed = [o for o in outcomes if not o.ok]
    for outcome in failed:
        print(f"\n--- {outcome.name}: {outcome.status}")
        if outcome.command:
            print(f"$ {outcome.command}\n{outcome.stderr_tail}")
    if failed:
        print(f"\nsmoke: failed: {', '.join(o.name for o in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(CASES, __doc__))
