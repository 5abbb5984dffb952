"""`ragblend eval`: answer quality (EM, F1, ROUGE-L), KV deviation and TTFT of every mode and
recompute ratio on a user's own model and JSONL dataset, in process (see docs/eval.md)."""

from __future__ import annotations

from typing import Any

__all__ = ["EvalReport", "evaluate"]


def __getattr__(name: str) -> Any:
    # Lazy: `ragblend` builds every subcommand's parser at start and must not load torch for it.
    if name in __all__:
        from evaluation import harness

        return getattr(harness, name)
    raise AttributeError(f"module 'evaluation' has no attribute {name!r}")
