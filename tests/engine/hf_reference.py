"""The model's own forward as the reference the engine's layer loops are held against."""

from __future__ import annotations

import inspect


def cache_keyword(model) -> str:
    """Newer transformers name the forward argument `cache`, older ones `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
