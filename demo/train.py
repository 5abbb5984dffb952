"""Train the demo model: a BPE tokenizer and a small Llama on engine-laid-out prompts.

    python -m demo.train --out demo/model --threads 1     # the shipped recipe
    python -m demo.train --device cuda --out /tmp/model           # the same, on a GPU

Prompts are built by the engine's own PromptBuilder (prefix | passages | question), so the model
sees at training time exactly the token layout the engine gives it; each prompt's passages are
followed by --questions question branches that see the passages but not each other (packed with
a block attention mask, exactly what each question's own prompt would compute). Loss: the
answer tokens and the EOS after them, plus a weighted next-token loss on the prompt
(--aux-weight). The model starts from a structured initialisation of its fact lookups
(circuit.py). Training uses full-prefill prompts only, never blended or reused caches.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from demo.circuit import Circuit, install
from demo.corpus import KINDS, CorpusGenerator, Example, Question
from engine.blend.layout import DEFAULT_SYSTEM_PROMPT, INSTRUCTION, PromptBuilder

log = logging.getLogger("demo.train")

# Validation uses its own seed; research/quality.py's held-out seed is different again.
VALIDATION_SEED = 999
# Kind weights (single, multi, context): the context and multi-hop questions are the hard ones.
TRAIN_WEIGHTS = (1.0, 1.2, 1.4)


def build_tokenizer(seed: int, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over generated passages and questions. Newlines are split off first so
    that every word carries its leading space wherever it stands (a name is the same tokens at
    the start of a passage, after a newline, and in a question)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    generator = CorpusGenerator(seed + 7)
    frame = f"{DEFAULT_SYSTEM_PROMPT}\n{INSTRUCTION}\n\nQuestion: \nAnswer:"
    texts = [frame] * 200
    for example in generator.examples(20_000):
        texts.extend(example.passages)
        texts.append(f"Question: {example.question}\nAnswer: {example.answer}")
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def model_config(vocab_size: int, tokenizer: PreTrainedTokenizerFast, args) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024,
        rope_theta=args.rope_theta,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@dataclass(frozen=True)
class Packed:
    """Passages once, then several question branches that each see the passages but not each
    other: tokens, their positions, and the answer tokens' offsets within each branch."""

    context: list[int]
    branches: list[list[int]]
    answer_starts: list[int]


def encode(
    builder: PromptBuilder, example: Example, extra: int = 0, rng: random.Random | None = None
) -> Packed:
    """The example's prompt and answer, plus up to `extra` more of the questions its passages
    answer, packed over one shared context (prefix + passages) as the engine lays it out."""
    questions = [Question(example.question, example.answer, example.kind)]
    if extra and example.also:
        pool = list(example.also)
        (rng or random).shuffle(pool)
        questions += pool[:extra]
    layout = builder.build(example.question, example.passages)
    context = list(layout.prefix) + [t for chunk in layout.chunks for t in chunk]
    branches, answer_starts = [], []
    for question in questions:
        suffix = list(builder.build(question.question, ()).suffix)
        answer = list(builder.encode(question.answer)) + [builder.tokenizer.eos_token_id]
        branches.append(suffix + answer)
        answer_starts.append(len(suffix))
    return Packed(context, branches, answer_starts)


def document(builder: PromptBuilder, example: Example) -> Packed:
    """The example's passages as a bare document after the engine's chunk-precompute prefix, the
    way a chunk is computed alone: no system prompt, no question, next-token loss only."""
    tokens = list(builder.chunk_prefix)
    for passage in example.passages:
        tokens += builder.chunk_tokens(passage)
    return Packed(tokens, [], [])


def collate(rows: list[Packed], pad_id: int):
    """input_ids, position_ids, a [B, 1, T, T] additive attention mask (causal; a branch sees
    the context and itself), next-token targets (-100: no loss) and the answer-position mask
    (the logit at p-1 predicts the token at p)."""
    width = max(len(r.context) + sum(len(b) for b in r.branches) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)
    targets = torch.full((len(rows), width), -100, dtype=torch.long)
    is_answer = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, row in enumerate(rows):
        n = len(row.context)
        input_ids[b, :n] = torch.tensor(row.context)
        positions[b, :n] = torch.arange(n)
        segment[b, :n] = 0
        targets[b, : n - 1] = torch.tensor(row.context[1:])
        if row.branches:
            targets[b, n - 1] = row.branches[0][0]
        start = n
        pairs = zip(row.branches, row.answer_starts, strict=True)
        for k, (branch, answer_start) in enumerate(pairs, 1):
            end = start + len(branch)
            input_ids[b, start:end] = torch.tensor(branch)
            positions[b, start:end] = torch.arange(n, n + len(branch))
            segment[b, start:end] = k
            targets[b, start : end - 1] = torch.tensor(branch[1:])
            is_answer[b, start + answer_start - 1 : end - 1] = True
            start = end
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = (segment[:, None, :] == segment[:, :, None]) | (segment[:, None, :] == 0)
    visible = causal & same & (segment[:, :, None] >= 0)
    visible |= torch.eye(width, dtype=torch.bool)  # padding rows attend to themselves only
    # Additive, not boolean: transformers' eager attention adds the mask to the scores, so a
    # boolean one would let every token see the future.
    blocked = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    return input_ids, positions, blocked[:, None], targets, is_answer


def losses(model: LlamaForCausalLM, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Answer loss, auxiliary next-token loss on the rest of the prompt, and answer logits."""
    input_ids, positions, visible, targets, is_answer = batch
    logits = model(input_ids=input_ids, position_ids=positions, attention_mask=visible).logits
    logits = logits.float()
    answer_logits = logits[is_answer]
    answer_loss = F.cross_entropy(answer_logits, targets[is_answer])
    rest = targets.masked_fill(is_answer, -100)
    rest_loss = F.cross_entropy(logits.flatten(0, 1), rest.flatten(), ignore_index=-100)
    return answer_loss, rest_loss, answer_logits


@torch.no_grad()
def teacher_forced_accuracy(model, builder, examples: list[Example]) -> dict[str, float]:
    """Share of examples whose every answer token (and EOS) is the argmax: greedy exact match."""
    model.eval()
    hits = {kind: [0, 0] for kind in KINDS}
    for start in range(0, len(examples), 32):
        part = examples[start : start + 32]
        batch = collate([encode(builder, e) for e in part], builder.tokenizer.pad_token_id)
        batch = [t.to(model.device) for t in batch]
        with torch.autocast(model.device.type, dtype=torch.bfloat16):
            _, _, logits = losses(model, batch)
        correct = logits.argmax(-1) == batch[3][batch[4]]
        rows = batch[4].nonzero()[:, 0]
        for b, example in enumerate(part):
            hits[example.kind][0] += bool(correct[rows == b].all())
            hits[example.kind][1] += 1
    model.train()
    return {kind: h / max(n, 1) for kind, (h, n) in hits.items()}


def learning_rate(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 5 % of the peak as `progress` goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def optimizers(model: LlamaForCausalLM, args) -> list[torch.optim.Optimizer]:
    """AdamW for everything, or Muon for the hidden layers' matrices and AdamW for the rest
    (embeddings and norms), as Muon is meant to be used. Each group keeps its peak lr."""
    matrices, rest = [], []
    for name, param in model.named_parameters():
        hidden_matrix = param.ndim == 2 and "embed" not in name
        (matrices if args.optimizer == "muon" and hidden_matrix else rest).append(param)
    chosen: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(rest, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    ]
    if matrices:
        chosen.append(
            torch.optim.Muon(matrices, lr=args.muon_lr, weight_decay=0.05, adjust_lr_fn="original")
        )
    for optimizer in chosen:
        for group in optimizer.param_groups:
            group["peak"] = group["lr"]
    return chosen


def save(model, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    copy = LlamaForCausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    copy.to(torch.bfloat16)
    copy.generation_config.eos_token_id = tokenizer.eos_token_id
    copy.generation_config.pad_token_id = tokenizer.pad_token_id
    copy.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo/model"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=Path, default=None, help="continue from this checkpoint")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="also decay by wall time; stop past it (not reproducible)",
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="muon")
    parser.add_argument("--muon-lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    parser.add_argument("--vocab", type=int, default=1536)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=640)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument(
        "--rope-theta",
        type=float,
        default=1e6,
        help="RoPE base: the circuit's lookups need slow pairs",
    )
    parser.add_argument(
        "--kind-weights",
        type=float,
        nargs=3,
        default=TRAIN_WEIGHTS,
        metavar=("SINGLE", "MULTI", "CONTEXT"),
        help="how often each kind of question is drawn",
    )
    parser.add_argument("--aux-weight", type=float, default=0.1)
    parser.add_argument("--short-steps", type=int, default=0, help="steps of short prompts first")
    parser.add_argument("--short-passages", type=int, default=2)
    parser.add_argument(
        "--questions", type=int, default=4, help="questions per prompt, packed over its passages"
    )
    parser.add_argument(
        "--documents", type=int, default=0, help="bare-document rows per batch (see document())"
    )
    parser.add_argument(
        "--circuit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="structured init of the fact lookups (circuit.py)",
    )
    parser.add_argument(
        "--second-hop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the structured init also wires the multi-hop lookup",
    )
    parser.add_argument("--eval-every", type=int, default=500)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.init is not None:
        # Continue from a saved checkpoint (its tokenizer and shape win over the flags).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init)
        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        tokenizer = build_tokenizer(args.seed, args.vocab)
        model = LlamaForCausalLM(model_config(len(tokenizer), tokenizer, args))
        if args.circuit:
            install(model, tokenizer, Circuit(second_hop=args.second_hop, seed=args.seed))
    # Plain matmul attention: on these short packed rows CPU SDPA's masked backward is slower.
    model.set_attn_implementation("eager")
    model.to(args.device)
    builder = PromptBuilder(tokenizer)
    log.info("model: %.2fM parameters, vocab %d", model.num_parameters() / 1e6, len(tokenizer))
    chosen = optimizers(model, args)
    generator = CorpusGenerator(args.seed)
    data_rng = random.Random(args.seed + 2)
    # Short prompts first: the copying heads form sooner on 1-2 passages than on 3-6.
    short_generator = CorpusGenerator(
        args.seed + 1, min_passages=1, max_passages=args.short_passages
    )
    validating = CorpusGenerator(VALIDATION_SEED)
    validation = [validating.example(KINDS[i % 3]) for i in range(240)]

    started = time.monotonic()
    model.train()
    running = 0.0
    for step in range(args.steps):
        # Without --minutes the schedule follows steps alone and the run is deterministic. With
        # it, progress is the larger of steps done and time used, so that a run on a busy
        # machine still ends with a decayed learning rate inside its time budget.
        elapsed_min = (time.monotonic() - started) / 60
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        if args.minutes:
            progress = max(progress, elapsed_min / args.minutes)
        for optimizer in chosen:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(progress, step, group["peak"], args.warmup)
        # Curriculum: 1 to --short-passages passages for the first --short-steps steps.
        source = short_generator if step < args.short_steps else generator
        examples = list(source.examples(args.batch, tuple(args.kind_weights)))
        rows = [encode(builder, e, args.questions - 1, data_rng) for e in examples]
        rows += [document(builder, e) for e in source.examples(args.documents)]
        batch = collate(rows, tokenizer.pad_token_id)
        batch = [t.to(args.device, non_blocking=True) for t in batch]
        with torch.autocast(args.device.type, dtype=torch.bfloat16):
            answer_loss, rest_loss, _ = losses(model, batch)
        # A small auxiliary loss on the prompt teaches the passage templates; weighted 1.0 it
        # kept every run on the answer-loss plateau (demo/README.md).
        loss = answer_loss + args.aux_weight * rest_loss
        for optimizer in chosen:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in chosen:
            optimizer.step()
        running = 0.98 * running + 0.02 * answer_loss.item() if step else answer_loss.item()
        elapsed_min = (time.monotonic() - started) / 60
        if step % 50 == 0:
            log.info(
                "step %d loss %.4f lr %.2e %.1f min",
                step,
                running,
                chosen[0].param_groups[0]["lr"],
                elapsed_min,
            )
        last = step == args.steps - 1 or progress >= 1.0
        if (step + 1) % args.eval_every == 0 or last:
            accuracy = teacher_forced_accuracy(model, builder, validation)
            log.info(
                "step %d validation exact match %s",
                step,
                {k: round(v, 3) for k, v in accuracy.items()},
            )
            save(model, tokenizer, args.out)
        if last:
            break
    log.info(
        "done: %d steps in %.1f min; saved to %s",
        step + 1,
        (time.monotonic() - started) / 60,
        args.out,
    )


if __name__ == "__main__":
    main()
