"""Writes tiny GGUF files with the gguf package's own writer: a random-init llama (byte-level
BPE vocabulary, float32 tensors) or a header of any architecture, for the conversion tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 16, 32, 4, 2, 2
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def byte_tokens() -> list[str]:
    """The 256 byte symbols of a byte-level BPE vocabulary (GPT-2's printable mapping)."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def write_tiny_llama_gguf(path: Path, seed: int = 0, merges: tuple[str, ...] = ("Ġ t",)) -> Path:
    """A 2-layer llama with GQA 4:2; `merges` naming tokens outside the vocabulary make a file
    whose header parses but whose tokenizer does not."""
    rng = np.random.default_rng(seed)
    tokens = [*byte_tokens(), "Ġt", *SPECIALS]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    kv_dim = KV_HEADS * (HIDDEN // HEADS)
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    _finish(writer)
    return path


def write_header_only_gguf(path: Path, architecture: str) -> Path:
    """A well-formed GGUF of `architecture` with one tensor and no model behind it."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    _finish(writer)
    return path


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
