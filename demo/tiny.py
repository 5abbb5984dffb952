"""Random-init checkpoints of every supported family, saved like real ones.

Tests load them through the real loading path; benchmarks use larger ones of the same shapes.
No download is involved: the tokenizer is a byte-level BPE trained here on generated words.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "tas",
    "vo",
    "zu",
    "pe",
    "dri",
    "sol",
    "an",
    "qu",
    "ber",
    "ix",
    "nor",
    "el",
    "fa",
    "gim",
    "hu",
    "jo",
    "wen",
    "yl",
    "os",
    "tre",
]


def random_words(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(count)]


def build_tokenizer(vocab_size: int = 512, chat_template: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with <s>/</s> (and ChatML tokens when `chat_template`)."""
    specials = ["<s>", "</s>", "<pad>"] + (["<|im_start|>", "<|im_end|>"] if chat_template else [])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        " ".join(random_words(40, seed)) + ". Question: Answer: passages." for seed in range(200)
    ]
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template:
        wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def model_config(
    family: str,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 2048,
    initializer_range: float = 0.02,
) -> PretrainedConfig:
    """A config of `family` with GQA; llama3 adds Llama-3 RoPE scaling, mistral a sliding window."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=initializer_range,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama3":
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": max(16, max_positions // 32),
            },
        )
    if family == "mistral":
        return MistralConfig(**common, sliding_window=max_positions // 16)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=hidden_size // num_heads)
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def save_random_checkpoint(
    family: str,
    path: str | Path,
    *,
    seed: int = 0,
    chat_template: bool = False,
    dtype: torch.dtype = torch.float32,
    tokenizer_vocab: int = 512,
    **shape,
) -> Path:
    """Write a random-init model of `family` and its tokenizer to `path` (save_pretrained)."""
    path = Path(path)
    tokenizer = build_tokenizer(tokenizer_vocab, chat_template=chat_template)
    config = model_config(family, vocab_size=len(tokenizer), **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
