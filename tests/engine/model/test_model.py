"""Model loading: families, dtypes, GGUF files, and the fingerprint that keys KV caches."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from demo.tiny import FAMILIES, save_random_checkpoint
from engine.errors import ModelCorruptError, ModelNotFoundError, ModelNotSupportedError
from engine.model.load import load_model
from tests import real_model
from tests.engine.tiny_gguf import write_header_only_gguf, write_tiny_llama_gguf
from tests.service_process import service_env


@pytest.mark.parametrize("family", FAMILIES)
def test_every_supported_family_loads_through_the_real_path(checkpoint_dir, family):
    loaded = load_model(checkpoint_dir(family))
    assert loaded.model.config.model_type == family.replace("llama3", "llama")
    assert loaded.dtype == torch.float32 and len(loaded.fingerprint) == 32


def test_fingerprint_is_stable_across_loads(checkpoint_dir):
    path = checkpoint_dir("qwen3")
    assert load_model(path).fingerprint == load_model(path).fingerprint


def test_fingerprint_differs_for_other_weights_and_other_dtype(checkpoint_dir, tmp_path):
    path = checkpoint_dir("llama")
    other = save_random_checkpoint(
        "llama", tmp_path / "other", seed=2, initializer_range=0.1, max_positions=1024
    )
    base = load_model(path)
    assert base.fingerprint != load_model(str(other)).fingerprint
    bf16 = load_model(path, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert base.fingerprint != bf16.fingerprint


smollm2_dir = real_model.smollm2_dir


def _cache_entries(cache) -> list[str]:
    """What a reader of the cache could find: everything but the lock files."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def test_a_gguf_file_is_converted_once_and_loads_with_a_stable_fingerprint(tmp_path):
    source = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    first = load_model(str(source), cache_dir=cache)
    (weights,) = cache.glob("*/tiny/model.safetensors")
    written_ns = weights.stat().st_mtime_ns
    # The folder holding the file names the same model; the cached conversion is reused.
    again = load_model(str(tmp_path), cache_dir=cache)
    assert again.fingerprint == first.fingerprint
    assert weights.stat().st_mtime_ns == written_ns
    assert first.model.config.model_type == "llama" and first.model.config.num_hidden_layers == 2
    assert first.tokenizer.bos_token == "<|im_start|>"
    assert first.tokenizer("hi").input_ids == [ord("h"), ord("i")]


def test_a_gguf_with_other_content_gets_its_own_conversion(tmp_path):
    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    first = load_model(
        str(write_tiny_llama_gguf(tmp_path / "a" / "m.gguf", seed=0)), cache_dir=cache
    )
    (tmp_path / "b").mkdir()
    other = load_model(
        str(write_tiny_llama_gguf(tmp_path / "b" / "m.gguf", seed=1)), cache_dir=cache
    )
    assert first.fingerprint != other.fingerprint
    assert len(_cache_entries(cache)) == 2


def test_a_gguf_of_another_architecture_is_refused_naming_it(tmp_path):
    source = write_header_only_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ModelNotSupportedError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model(str(source), cache_dir=tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


@pytest.mark.parametrize("damage", ["random bytes", "cut in the header", "cut in the tensors"])
def test_a_corrupt_gguf_is_a_clear_error_that_leaves_nothing_readable(tmp_path, damage):
    data = write_tiny_llama_gguf(tmp_path / "good.gguf").read_bytes()
    damaged = {
        "random bytes": bytes(range(256)) * 64,
        "cut in the header": data[:100],
        "cut in the tensors": data[:-100],
    }[damage]
    source = tmp_path / "bad" / "model.gguf"
    source.parent.mkdir()
    source.write_bytes(damaged)
    with pytest.raises(ModelCorruptError, match="model.gguf' is not a readable GGUF file"):
        load_model(str(source), cache_dir=tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


def test_a_gguf_whose_vocabulary_does_not_build_fails_before_anything_is_cached(tmp_path):
    source = write_tiny_llama_gguf(tmp_path / "m.gguf", merges=("x y",))
    with pytest.raises(ModelCorruptError, match="could not be dequantized"):
        load_model(str(source), cache_dir=tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


def test_a_folder_with_two_gguf_files_asks_for_one(tmp_path):
    write_tiny_llama_gguf(tmp_path / "a.gguf")
    write_tiny_llama_gguf(tmp_path / "b.gguf")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        load_model(str(tmp_path), cache_dir=tmp_path / "cache")


def test_the_packaged_smollm2_converts_into_a_chatml_llama_that_answers(smollm2_dir):
    loaded = load_model(str(smollm2_dir), dtype="bfloat16")
    config = loaded.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (
        30,
        576,
        3,
    )
    tokenizer = loaded.tokenizer
    assert tokenizer.bos_token == "<|im_start|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    output = loaded.model.generate(input_ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, input_ids.shape[1] :])


def test_the_engine_service_refuses_a_corrupt_gguf_in_one_line(tmp_path):
    source = tmp_path / "broken.gguf"
    source.write_bytes(b"GGUF" + bytes(200))
    done = subprocess.run(
        [sys.executable, "-m", "ragblend", "engine", "--model", str(source)],
        cwd=tmp_path,
        env=service_env(RAGBLEND_MODEL_CACHE=str(tmp_path / "cache")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "ragblend engine: error: model" in done.stderr and "Traceback" not in done.stderr
