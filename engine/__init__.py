"""CacheBlend engine: model loading, prompt layout, chunk KV precompute, blending and decoding.
The public API: `from engine import Engine, Chunk, GenerateRequest, Mode` (docs/engine.md)."""

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
    Mode,
    Penalties,
    PrecomputeResult,
    Selection,
    TokenDelta,
    Usage,
)

__all__ = [
    "BackgroundQueueFullError",
    "Chunk",
    "ChunkOrder",
    "ChunkTooLongError",
    "Engine",
    "EngineOptions",
    "GenerateRequest",
    "GenerateResult",
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
    "Usage",
]
