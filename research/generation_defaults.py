"""Repetition and correctness of answers under sampling settings, on the project's docs.

Asks 20 questions over passages of docs/*.md (the block holding the answer and the one before
it). Each prompt is prefilled once (full prefill), its KV copied into the blocks of one lane
per penalty setting, and all settings then decode together as one batch through the engine's
runner and penalty state, as the engine's decode step does; each setting then picks its token
with the engine's Sampler (greedy at temperature 0, else seeded temperature + top-p sampling).
Reports per setting: the share of repeated 3-grams in the answers, the answers naming the right
fact, the mean answer length.
Prints a table and writes bench/results/generation_defaults.csv.
"""

from __future__ import annotations

import argparse
import csv
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import _on_path  # noqa: E402, F401  (bench/ on sys.path)
import torch
from paths import results_dir, shown

from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine
from engine.sched.blocks import BlockManager
from engine.sched.sampling import Sampler
from engine.types import Chunk, GenerateRequest, Mode, Penalties

ROOT = Path(__file__).parent.parent


@dataclass(frozen=True)
class Question:
    doc: str  # a file of docs/
    anchor: str  # a string of the block that holds the answer
    text: str
    facts: tuple[str, ...]  # the answer is right when it contains one of them


# Interleaved by document, so that a run cut short still covers every document.
QUESTIONS = (
    Question(
        "gateway.md",
        "`RAGBLEND_GATEWAY_PORT`",
        "What is the gateway's default port?",
        ("8000",),
    ),
    Question(
        "engine.md",
        "| `max_num_seqs` |",
        "How many sequences does the engine decode together at most by default?",
        ("16", "sixteen"),
    ),
    Question(
        "kvstore.md",
        "setting is `kv_encoding` (`RAGBLEND_ENGINE_KV_ENCODING`)",
        "Which encoding do new SSD entries of the KV store use by default?",
        ("int8",),
    ),
    Question(
        "architecture.md",
        "retriever 8001, engine 8002",
        "On which port does the retriever listen?",
        ("8001",),
    ),
    Question(
        "retriever.md",
        "A chunk holds at most `chunk_tokens` tokens",
        "How many tokens does a chunk hold at most by default?",
        ("512",),
    ),
    Question(
        "gateway.md",
        "`RAGBLEND_GATEWAY_API_KEYS`",
        "Which environment variable sets the gateway's API keys?",
        ("RAGBLEND_GATEWAY_API_KEYS",),
    ),
    Question(
        "engine.md",
        "| `min_recompute_ratio` |",
        "What is the controller's lowest recompute ratio by default?",
        ("0.15", "15"),
    ),
    Question(
        "kvstore.md",
        "`gpu_promote_hits` times",
        "After how many hits in host memory is a chunk promoted to the gpu tier?",
        ("2", "two"),
    ),
    Question(
        "architecture.md",
        "retriever 8001, engine 8002",
        "What kind of settings class does each service have?",
        ("pydantic",),
    ),
    Question(
        "retriever.md",
        "A chunk holds at most `chunk_tokens` tokens",
        "Why do chunks not overlap by default?",
        ("repeat",),
    ),
    Question(
        "gateway.md",
        "`RAGBLEND_GATEWAY_DEFAULT_TOP_K`",
        "How many chunks does the gateway retrieve when a request gives no top_k?",
        ("4", "four"),
    ),
    Question(
        "engine.md",
        "| `system_prompt` |",
        "What is the engine's default system prompt?",
        ("helpful assistant",),
    ),
    Question(
        "kvstore.md",
        "`gpu_promote_hits` times",
        "Which setting of the engine service sizes the gpu tier?",
        ("gpu_tier_gb", "gpu_tier_share"),
    ),
    Question(
        "gateway.md",
        "`RAGBLEND_GATEWAY_DEFAULT_MAX_TOKENS`",
        "What answer length does the gateway use when a request gives no max_tokens?",
        ("128",),
    ),
    Question(
        "engine.md",
        "| `max_tokens_limit` |",
        "What is the largest max_tokens the engine accepts?",
        ("4096",),
    ),
    Question(
        "gateway.md",
        "`RAGBLEND_GATEWAY_MAX_TOP_K`",
        "What is the largest top_k the gateway accepts?",
        ("32",),
    ),
    Question(
        "engine.md",
        "| `lookahead` |",
        "How many layers may the KV loader run ahead by default?",
        ("2", "two"),
    ),
    Question(
        "gateway.md",
        "`RAGBLEND_GATEWAY_MODEL_NAME`",
        "Which model id does the gateway list at /v1/models by default?",
        ("ragblend",),
    ),
    Question(
        "gateway.md",
        "`RAGBLEND_GATEWAY_SHUTDOWN_GRACE_S`",
        "How long does the gateway drain in-flight streams at SIGTERM?",
        ("30",),
    ),
    Question(
        "gateway.md",
        "`RAGBLEND_GATEWAY_CORS_ORIGINS`",
        "Which gateway setting lists the browser origins allowed?",
        ("cors_origins", "CORS_ORIGINS"),
    ),
)


@dataclass(frozen=True)
class Setting:
    name: str
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0


# The first is greedy without penalties; the sampled ones are what a client's defaults bring
# (OpenAI's temperature 1.0) and the usual chat settings, each with the bundled frequency 0.3.
SETTINGS = (
    Setting("none"),
    Setting("repetition 1.1", repetition=1.1),
    Setting("repetition 1.2", repetition=1.2),
    Setting("repetition 1.3", repetition=1.3),
    Setting("frequency 0.3", frequency=0.3),
    Setting("frequency 0.5", frequency=0.5),
    Setting("presence 0.5", presence=0.5),
    Setting("repetition 1.1 + frequency 0.3", frequency=0.3, repetition=1.1),
    Setting("temperature 0.3 + frequency 0.3", temperature=0.3, frequency=0.3),
    Setting("temperature 0.7 top_p 0.9 + frequency 0.3", 0.7, 0.9, frequency=0.3),
    Setting("temperature 1.0 + frequency 0.3", temperature=1.0, frequency=0.3),
    Setting("temperature 1.0 (OpenAI's default)", temperature=1.0),
)
SEED = 20261206  # each sampled answer's seed: the same draws in every run


def passages(question: Question) -> tuple[Chunk, ...]:
    """The blank-line block of the doc that holds the anchor, after the block before it."""
    blocks = [b for b in re.split(r"\n\s*\n", (ROOT / "docs" / question.doc).read_text()) if b]
    at = next(i for i, block in enumerate(blocks) if question.anchor in block)
    return tuple(Chunk(f"{question.doc}#{i}", blocks[i]) for i in range(max(0, at - 1), at + 1))


def repeated_3gram_share(token_ids: list[int]) -> float:
    """Share of the answer's 3-grams that already occurred earlier in it (0: no repetition)."""
    grams = [tuple(token_ids[i : i + 3]) for i in range(len(token_ids) - 2)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


@torch.inference_mode()
def answers(engine: Engine, question: Question, max_tokens: int) -> list[list[int]]:
    """The answer's token ids under each of SETTINGS (lane i: setting i)."""
    runner = engine.runner
    layout = engine.layout(
        GenerateRequest(question=question.text, chunks=passages(question), max_tokens=max_tokens)
    )
    n = layout.num_tokens
    prefill = run_to_end(engine.prefiller.prefill(layout, PrefillAsk(Mode.FULL_PREFILL)))
    pool = BlockManager(runner.num_blocks, runner.block_size)
    tables = [pool.allocate(lane, n + max_tokens) for lane in range(len(SETTINGS))]
    for table in tables:  # one prompt, its KV in every setting's blocks
        runner.write_prompt(table, prefill.output.keys, prefill.output.values)
    penalties = [Penalties(s.presence, s.frequency, s.repetition) for s in SETTINGS]
    samplers = [Sampler(s.temperature, s.top_p, SEED) for s in SETTINGS]
    for lane in range(len(SETTINGS)):
        runner.penalties.start(lane, layout.token_ids)
    tokens: list[list[int]] = [[] for _ in SETTINGS]
    live = list(range(len(SETTINGS)))
    logits = prefill.output.logits[None].expand(len(live), -1)
    while True:
        penalised = runner.penalties.apply(logits, live, [penalties[s] for s in live])
        chosen = [samplers[lane](row) for lane, row in zip(live, penalised, strict=True)]
        for lane, token in zip(list(live), chosen, strict=True):
            if token in engine.eos_ids:
                live.remove(lane)
                continue
            tokens[lane].append(token)
            runner.penalties.add(lane, token)
            if len(tokens[lane]) == max_tokens:
                live.remove(lane)
        if not live:
            return tokens
        position = n + len(tokens[live[0]]) - 1
        logits = runner.decode(
            [tables[s] for s in live], [position] * len(live), [tokens[s][-1] for s in live]
        )


def summary(per_setting: list[list[tuple[float, bool, int]]]) -> list[dict]:
    """One row per setting: mean repeated 3-gram share, right answers, mean answer length."""
    return [
        {
            "setting": setting.name,
            "temperature": setting.temperature,
            "top_p": setting.top_p,
            "presence_penalty": setting.presence,
            "frequency_penalty": setting.frequency,
            "repetition_penalty": setting.repetition,
            "repeated_3grams": round(sum(r for r, _, _ in measured) / len(measured), 3),
            "right_fact": sum(ok for _, ok, _ in measured),
            "questions": len(measured),
            "mean_tokens": round(sum(t for _, _, t in measured) / len(measured), 1),
        }
        for setting, measured in zip(SETTINGS, per_setting, strict=True)
    ]


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (e.g. SmolLM2's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--out", type=Path, default=results_dir() / "generation_defaults.csv")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    engine = Engine.from_pretrained(
        args.model, dtype=args.dtype, max_model_len=4096, max_num_seqs=len(SETTINGS)
    )
    questions = QUESTIONS[: args.questions]
    per_setting: list[list[tuple[float, bool, int]]] = [[] for _ in SETTINGS]
    try:
        for question in questions:
            start = time.perf_counter()
            for setting, ids in enumerate(answers(engine, question, args.max_tokens)):
                text = engine.tokenizer.decode(ids, skip_special_tokens=True)
                right = any(f.lower() in text.lower() for f in question.facts)
                per_setting[setting].append((repeated_3gram_share(ids), right, len(ids)))
                print(f"{SETTINGS[setting].name:>42} {'ok ' if right else 'no '} {text!r}")
            print(f"--- {question.text} ({time.perf_counter() - start:.0f} s)", flush=True)
            rows = summary(per_setting)
            write_csv(rows, args.out)  # after every question: a long run can be read midway
    finally:
        engine.close()
    print("\n| setting | repeated 3-grams | right fact | mean tokens |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['setting']} | {row['repeated_3grams']:.3f} "
            f"| {row['right_fact']}/{row['questions']} | {row['mean_tokens']} |"
        )
    print(f"\nwrote {shown(args.out)}")


if __name__ == "__main__":
    main()
