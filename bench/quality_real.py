"""Quality of blending on a real model (SmolLM2-135M-Instruct by default) over real text: teacher-
forced KL from full prefill and prefill time of every mode, selection, r and check layer set.

    .venv/bin/python bench/quality_real.py --threads 2     # 24 prompts of 4 x 128 tokens
    .venv/bin/python bench/quality_real.py --prompts 8 --ratios 0.15 --check-layers 1 --coverages
    .venv/bin/python bench/quality_real.py --from-csv      # the tables and plot of the last run

Prompts: `evaluation.real_text` (CPython's language reference and Debian's common licenses: they
do not change with the repository), each of --chunks-per-prompt consecutive chunks of one
document cut by the retriever's chunking (--chunk-tokens of the model's tokenizer) and a question
on its first section. Per prompt, full prefill's greedy answer (--answer-tokens) is fed after
each setting's prompt KV and the next-token distributions are compared at every answer position
(evaluation.teacher_forcing). Settings: full_prefill, prefix_cache, full_reuse; cacheblend with
every --selections (the oracles of engine/oracle.py included) at every --ratios on the first
--check-layers set, --deep-selections at every ratio on the next --curves - 1 sets, every serving
selection at --layer-ratios on the other sets, and the auto ratio at each --coverages on the
curve sets. Prefill time is that of the prompt with every chunk's KV in RAM, what its TTFT is
made of.

Writes bench/results/quality_real.csv (one row per setting), bench/results/quality_real-
prompts.csv (one per prompt and setting) and docs/quality_real.png (KL against prefill time
relative to full prefill), and prints the table and each curve against HKVD at r = 0.15.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.paths import plots_dir, results_dir  # noqa: E402
from bench.quality_real_report import (  # noqa: E402
    FIELDS,
    read_rows,
    report,
    summarize,
    write_per_prompt,
)
from engine.blend.selection import Selection  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.quality.oracle import Oracle  # noqa: E402
from engine.types import AUTO_RATIO, Mode  # noqa: E402
from evaluation.compare import Case, Variant, compare_prompts  # noqa: E402
from evaluation.real_text import build_prompts  # noqa: E402

log = logging.getLogger("bench.quality_real")

RATIOS = (0.01, 0.05, 0.1, 0.15, 0.3, 0.5)
# Check layer sets: the first CURVES get every ratio. Layer 1; layers 1 and 7 (a quarter of
# SmolLM2's 30 layers: the selections that read the question's attention read it at the last);
# layer 2; gradual filtering over layers 1-3.
CHECK_LAYERS = ("1", "1,7", "2", "1,2,3")
CURVES = 2
DEEP_SELECTIONS = ("hkvd", "weighted", "query_hkvd")
LAYER_RATIOS = (0.15,)
COVERAGES = (0.8, 0.9, 0.95)
VARIANT_MODEL_LEN = 2048
VARIANT_POOL_BYTES = 256 << 20


@dataclass(frozen=True)
class Setting:
    label: str
    mode: Mode
    selection: str = ""  # a Selection's value, or "oracle-<kind>"
    check_layers: str = ""  # e.g. "1" or "1,2,3"
    recompute_ratio: float | str | None = None
    auto_coverage: float | None = None

    @property
    def oracle(self) -> Oracle | None:
        prefix = "oracle-"
        return Oracle(self.selection[len(prefix) :]) if self.selection.startswith(prefix) else None


def settings_for(
    ratios: list[float],
    check_layers: list[str],
    curves: int,
    layer_ratios: list[float],
    selections: list[str],
    deep_selections: list[str],
    coverages: list[float],
) -> list[Setting]:
    """The baselines; at the first `curves` check layer sets every selection (`deep_selections`
    after the first set, the oracles at the first only) at every ratio and at the auto ratio of
    each coverage; at the other sets every serving selection at `layer_ratios`."""
    settings = [Setting(Mode.PREFIX_CACHE.value, Mode.PREFIX_CACHE)]
    settings.append(Setting(Mode.FULL_REUSE.value, Mode.FULL_REUSE))
    serving = [s for s in selections if not s.startswith("oracle-")]
    for index, layers in enumerate(check_layers):
        if index >= curves:
            chosen, set_ratios = serving, layer_ratios
        else:
            chosen = selections if index == 0 else [s for s in serving if s in deep_selections]
            set_ratios = ratios
        for ratio in set_ratios:
            for selection in chosen:
                label = f"cacheblend@{ratio:g} {selection} L{layers}"
                settings.append(Setting(label, Mode.CACHEBLEND, selection, layers, ratio))
        if index >= curves:
            continue
        for coverage in coverages:
            for selection in chosen:
                if selection.startswith("oracle-") or selection == Selection.RANDOM.value:
                    continue
                label = f"cacheblend@auto{coverage:g} {selection} L{layers}"
                settings.append(
                    Setting(label, Mode.CACHEBLEND, selection, layers, AUTO_RATIO, coverage)
                )
    return settings


def variant_of(setting: Setting, reference: Engine, engines: dict) -> Variant:
    if not setting.check_layers:
        return Variant(setting.label, reference, setting.mode)
    oracle = setting.oracle
    return Variant(
        setting.label,
        engines[setting.check_layers, setting.auto_coverage],
        setting.mode,
        setting.recompute_ratio,
        None if oracle is not None else Selection(setting.selection),
        oracle,
    )


def positive(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 1000:
        raise argparse.ArgumentTypeError(f"must be in 1..1000, got {number}")
    return number


def ratio(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"a recompute ratio is in (0, 1], got {number}")
    return number


def layers(value: str) -> str:
    try:
        numbers = [int(layer) for layer in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"check layers are comma-separated ints, got {value!r}"
        ) from None
    if any(n < 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"check layers are >= 0, got {value!r}")
    return ",".join(str(n) for n in sorted(set(numbers)))


def default_model() -> str:
    """The packaged SmolLM2, converted once and cached (tests/real_model.py)."""
    from tests.real_model import smollm2_checkpoint

    return str(smollm2_checkpoint())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the packaged SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=positive, default=24)
    parser.add_argument("--chunk-tokens", type=positive, default=128)
    parser.add_argument("--chunks-per-prompt", type=positive, default=4)
    parser.add_argument("--answer-tokens", type=positive, default=16)
    parser.add_argument("--ratios", type=ratio, nargs="+", default=list(RATIOS))
    parser.add_argument(
        "--check-layers",
        type=layers,
        nargs="+",
        default=list(CHECK_LAYERS),
        help="check layer sets, e.g. 1 2 1,2,3 (every ratio at the first, --layer-ratios at "
        "the others)",
    )
    parser.add_argument(
        "--curves",
        type=positive,
        default=CURVES,
        help="how many of the first check layer sets get every ratio",
    )
    parser.add_argument(
        "--deep-selections",
        nargs="+",
        choices=[s.value for s in Selection],
        default=list(DEEP_SELECTIONS),
        help="the selections measured at every ratio on the curve sets after the first",
    )
    parser.add_argument(
        "--selections",
        nargs="+",
        choices=[s.value for s in Selection] + [f"oracle-{o.value}" for o in Oracle],
        default=[s.value for s in Selection] + [f"oracle-{o.value}" for o in Oracle],
    )
    parser.add_argument(
        "--coverages",
        type=ratio,
        nargs="*",
        default=list(COVERAGES),
        help="auto ratio: the shares of the selection's mass covered (none: no auto settings)",
    )
    parser.add_argument("--auto-max-ratio", type=ratio, default=0.5)
    parser.add_argument("--layer-ratios", type=ratio, nargs="+", default=list(LAYER_RATIOS))
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--csv", type=Path, default=results_dir() / "quality_real.csv")
    parser.add_argument("--png", type=Path, default=plots_dir() / "quality_real.png")
    parser.add_argument(
        "--prompts-csv",
        type=Path,
        default=results_dir() / "quality_real-prompts.csv",
        help="one row per prompt and setting",
    )
    parser.add_argument(
        "--from-csv",
        action="store_true",
        help="measure nothing: the tables and the plot of the rows already in --csv",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.from_csv:
        rows = read_rows(args.csv)
        name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
        report(rows, args, title_of(name, int(rows[0]["prompts"]), args))
        return
    torch.set_num_threads(args.threads)
    model = args.model or default_model()

    started = time.perf_counter()
    reference = Engine.from_pretrained(model, dtype=args.dtype, max_num_seqs=1)
    settings = settings_for(
        args.ratios,
        args.check_layers,
        args.curves,
        args.layer_ratios,
        args.selections,
        args.deep_selections,
        args.coverages,
    )
    engines = {
        (s.check_layers, s.auto_coverage): Engine(
            reference.loaded,
            reference.store,
            check_layers=tuple(int(layer) for layer in s.check_layers.split(",")),
            auto_coverage=s.auto_coverage or 0.5,
            auto_max_ratio=args.auto_max_ratio,
            max_num_seqs=1,
            # Prefills here build their KV outside the pool: a small pool per engine.
            max_model_len=min(VARIANT_MODEL_LEN, reference.max_model_len),
            kv_pool_bytes=VARIANT_POOL_BYTES,
        )
        for s in settings
        if s.check_layers
    }
    variants = [variant_of(s, reference, engines) for s in settings]
    prompts = build_prompts(
        reference.tokenizer,
        chunk_tokens=args.chunk_tokens,
        chunks_per_prompt=args.chunks_per_prompt,
        limit=args.prompts,
    )
    if len(prompts) < args.prompts:
        log.warning("only %d prompts of %d chunks exist", len(prompts), args.chunks_per_prompt)
    cases = [Case(p.question, p.passages, variants) for p in prompts]
    results = []
    try:
        compared = compare_prompts(reference, cases, args.answer_tokens)
        for result in tqdm(
            compared, desc=f"{len(settings) + 1} settings", total=len(cases), unit="prompt"
        ):
            results.append(result)
    finally:
        for engine in engines.values():
            engine.close()
        reference.close()
    seconds = time.perf_counter() - started
    rows = summarize(settings, results)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    write_per_prompt(results, settings, args.prompts_csv)
    title = title_of(Path(model).name, len(results), args)
    print(f"\n{title} ({seconds:.0f} s, {args.threads} threads)\n")
    report(rows, args, title)


def title_of(name: str, prompts: int, args: argparse.Namespace) -> str:
    return (
        f"{name}, {args.dtype}: {prompts} real-text prompts of {args.chunks_per_prompt} x "
        f"{args.chunk_tokens}-token chunks, {args.answer_tokens} answer tokens"
    )


if __name__ == "__main__":
    main()
