"""CacheBlend engine: model loading, prompt layout, chunk KV precompute, blending and decoding.
The public API: `from engine import Engine, Chunk, GenerateRequest, Mode` (docs/engine.md)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.errors import (
        BackgroundQueueFullError,
        ChunkTooLongError,
        GenerationCancelled,
        InvalidRequestError,
        ModelNotFoundError,
        ModelNotSupportedError,
        PromptTooLongError,
        QueueFullError,
    )
    from engine.options import EngineOptions
    from engine.streaming import Generation
    from engine.types import (
        Chunk,
        ChunkOrder,
        GenerateRequest,
        GenerateResult,
        GenerationDefaults,
        Mode,
        Penalties,
        PrecomputeResult,
        Selection,
        TokenDelta,
        Turn,
        Usage,
    )

# name -> the module that defines it; imported on first use, so that importing one
# module of the package (`python -m engine.model.gguf`, engine.types) loads no other.
_EXPORTS = {
    "BackgroundQueueFullError": "engine.errors",
    "Chunk": "engine.types",
    "ChunkOrder": "engine.types",
    "ChunkTooLongError": "engine.errors",
    "Engine": "engine.engine",
    "EngineOptions": "engine.options",
    "GenerateRequest": "engine.types",
    "GenerateResult": "engine.types",
    "GenerationDefaults": "engine.types",
    "Generation": "engine.streaming",
    "GenerationCancelled": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "Mode": "engine.types",
    "ModelNotFoundError": "engine.errors",
    "ModelNotSupportedError": "engine.errors",
    "Penalties": "engine.types",
    "PrecomputeResult": "engine.types",
    "PromptTooLongError": "engine.errors",
    "QueueFullError": "engine.errors",
    "Selection": "engine.types",
    "TokenDelta": "engine.types",
    "Turn": "engine.types",
    "Usage": "engine.types",
}

__all__ = [
    "BackgroundQueueFullError",
    "Chunk",
    "ChunkOrder",
    "ChunkTooLongError",
    "Engine",
    "EngineOptions",
    "GenerateRequest",
    "GenerateResult",
    "GenerationDefaults",
    "Generation",
    "GenerationCancelled",
    "InvalidRequestError",
    "Mode",
    "ModelNotFoundError",
    "ModelNotSupportedError",
    "Penalties",
    "PrecomputeResult",
    "PromptTooLongError",
    "QueueFullError",
    "Selection",
    "TokenDelta",
    "Turn",
    "Usage",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
