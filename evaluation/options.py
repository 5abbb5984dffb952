"""What one evaluation run does: the model, the settings to compare and the context source,
validated once for both the command line and the Python function."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.types import ChunkOrder, Mode

DEFAULT_MODES = (Mode.FULL_PREFILL, Mode.PREFIX_CACHE, Mode.FULL_REUSE, Mode.CACHEBLEND)
DEFAULT_RATIOS = (0.05, 0.15, 0.3, 0.5)

Ratio = Annotated[float, Field(ge=0.0, le=1.0)]


class EvalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="checkpoint directory (or cached hub id)")
    modes: tuple[Mode, ...] = Field(DEFAULT_MODES, min_length=1, max_length=len(Mode))
    ratios: tuple[Ratio, ...] = Field(DEFAULT_RATIOS, min_length=1, max_length=32)
    retrieval: bool = Field(False, description="passages from an in-process retriever")
    corpus: Path | None = Field(None, description="JSONL documents to retrieve from")
    top_k: int = Field(5, ge=1, le=100)
    max_tokens: int = Field(32, ge=1, le=4096)
    teacher_forced_tokens: int = Field(
        16, ge=1, le=256, description="tokens of full prefill's greedy answer fed to each setting"
    )
    chunk_order: ChunkOrder = Field(
        ChunkOrder.BEST_FIRST,
        description="best_last: the passages (best first) laid out reversed, as the gateway can",
    )
    limit: int | None = Field(None, ge=1, description="evaluate only the first N records")
    device: str = Field("cpu", min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    plot: bool = True
    progress: bool = True

    @field_validator("corpus")
    @classmethod
    def _corpus_needs_retrieval(cls, corpus: Path | None, info) -> Path | None:
        if corpus is not None and not info.data.get("retrieval"):
            raise ValueError("a corpus is only used with retrieval on")
        return corpus
