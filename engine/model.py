"""Loads a Hugging Face causal LM of a supported family and fingerprints it.

The fingerprint keys every stored KV cache, so KV computed by one model (or dtype) is never
served to another.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine.errors import ModelNotFoundError, ModelNotSupportedError

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Values sampled per weight tensor for the fingerprint: enough to tell two inits apart, cheap
# enough to hash a 70B model at load.
_FINGERPRINT_SAMPLES = 4096


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    path: str


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def load_model(path: str, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load a local checkpoint directory or a hub id from the local cache.

    Raises ModelNotFoundError when nothing is there, ModelNotSupportedError for another family.
    """
    torch_dtype = parse_dtype(dtype)
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
        path,
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
