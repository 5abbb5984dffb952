"""Loads a Hugging Face causal LM of a supported family and fingerprints it.

The fingerprint keys every stored KV cache, so KV computed by one model (or dtype) is never
served to another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine.errors import ModelNotFoundError, ModelNotSupportedError
from engine.model.gguf import convert_gguf, is_gguf
from engine.types import GenerationDefaults

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Values sampled per weight tensor for the fingerprint: enough to tell two inits apart, cheap
# enough to hash a 70B model at load.
_FINGERPRINT_SAMPLES = 4096
# Converted GGUF checkpoints, beside the SSD tier's default data/kv.
DEFAULT_MODEL_CACHE = Path("data/models")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    path: str

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The sampling defaults the checkpoint's generation_config.json sets (vLLM's
        `--generation-config auto`): its temperature, top_p and repetition_penalty, each only
        where the file names it; none without the file."""
        config = getattr(self.model, "generation_config", None)
        given = config.to_diff_dict() if config is not None else {}

        def value(name: str) -> float | None:
            found = given.get(name)
            return float(found) if isinstance(found, int | float) else None

        return GenerationDefaults(
            temperature=value("temperature"),
            top_p=value("top_p"),
            repetition_penalty=value("repetition_penalty"),
        )

    @property
    def name(self) -> str:
        """The model as configured, a checkpoint directory reduced to its name (no path)."""
        return (
            os.path.basename(os.path.normpath(self.path)) if os.path.isdir(self.path) else self.path
        )


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def model_cache_dir() -> Path:
    """Where GGUF conversions are kept: RAGBLEND_MODEL_CACHE, else data/models."""
    return Path(os.environ.get("RAGBLEND_MODEL_CACHE") or DEFAULT_MODEL_CACHE)


def resolve_checkpoint(path: str, cache_dir: Path | None = None) -> str:
    """`path` itself, or for a GGUF file (or a folder holding one) its converted checkpoint
    folder in `cache_dir` (default model_cache_dir()), converting it on first use.

    Raises ModelNotFoundError, ModelNotSupportedError or ModelCorruptError (engine.model.gguf).
    """
    if not is_gguf(path):
        return path
    return str(convert_gguf(path, cache_dir or model_cache_dir()))


def load_model(
    path: str, device: str = "cpu", dtype: str = "float32", cache_dir: Path | None = None
) -> LoadedModel:
    """Load a local checkpoint directory, a GGUF file (converted once, see resolve_checkpoint)
    or a hub id from the local cache.

    Raises ModelNotFoundError when nothing is there (ModelCorruptError, a kind of it, for an
    unreadable GGUF), ModelNotSupportedError for another family.
    """
    torch_dtype = parse_dtype(dtype)
    source = path
    path = resolve_checkpoint(path, cache_dir)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"model {path!r} not found: not a checkpoint directory nor a hub id in the local "
            f"cache ({exc.__class__.__name__})"
        ) from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelNotSupportedError(
            f"model type {config.model_type!r} of {path!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation="sdpa"
    )
    # transformers types `to` as taking the model itself; it takes a device like torch's.
    model.to(device).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fingerprint = model_fingerprint(model)
    log.info(
        "loaded %s (%s, %s on %s), fingerprint %s",
        source,
        config.model_type,
        dtype,
        device,
        fingerprint[:12],
    )
    return LoadedModel(model, tokenizer, fingerprint, torch.device(device), torch_dtype, str(path))


def model_fingerprint(model: PreTrainedModel) -> str:
    """A hash of the config and of a strided sample of every weight, in its loaded dtype."""
    digest = hashlib.sha256()
    config = model.config.to_diff_dict()
    config.pop("transformers_version", None)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
        sample = flat[::stride][:_FINGERPRINT_SAMPLES].contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.hexdigest()[:32]
