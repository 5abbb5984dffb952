"""What one evaluation run does: the model, the settings to compare and the context source,
validated once for both the command line and the Python function."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.contract import Selection
from engine.types import ChunkOrder, Mode

DEFAULT_MODES = (Mode.FULL_PREFILL, Mode.PREFIX_CACHE, Mode.FULL_REUSE, Mode.CACHEBLEND)
DEFAULT_RATIOS = (0.05, 0.15, 0.3, 0.5)

Ratio = Annotated[float, Field(ge=0.0, le=1.0)]


class EvalOptions(BaseModel):
    """Each field but `progress` is a flag of `ragblend eval` (evaluation/cli.py), described by
    its help; a bool that defaults to True is the flag `--no-NAME`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="checkpoint directory (or cached hub id)")
    modes: tuple[Mode, ...] = Field(
        DEFAULT_MODES,
        min_length=1,
        max_length=len(Mode),
        description="modes to compare (full_prefill always runs: it is the reference)",
    )
    ratios: tuple[Ratio, ...] = Field(
        DEFAULT_RATIOS, min_length=1, max_length=32, description="cacheblend recompute ratios"
    )
    selections: tuple[Selection, ...] = Field(
        (),
        max_length=len(Selection),
        description="cacheblend token selections to compare, each at every ratio "
        "(default: the engine's own)",
    )
    retrieval: bool = Field(
        False,
        description="retrieve each question's passages (top-k) instead of using the record's",
    )
    corpus: Path | None = Field(
        None,
        description='with --retrieval: JSONL of {"text": ...} documents '
        "(default: every record's passages)",
    )
    top_k: int = Field(5, ge=1, le=100, description="passages retrieved per question")
    max_tokens: int = Field(32, ge=1, le=4096, description="tokens generated per answer")
    teacher_forced_tokens: int = Field(
        16,
        ge=1,
        le=256,
        description="tokens of full prefill's greedy answer fed after each setting's KV (1-256)",
    )
    chunk_order: ChunkOrder = Field(
        ChunkOrder.BEST_FIRST,
        description="best_last: the passages laid out reversed, the first next to the question",
    )
    limit: int | None = Field(None, ge=1, description="evaluate only the first N records")
    device: str = Field("cpu", min_length=1, description="cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the model's weights and KV"
    )
    plot: bool = Field(True, description="draw the PNG plot (needs matplotlib); --no-plot skips it")
    progress: bool = True

    @field_validator("corpus")
    @classmethod
    def _corpus_needs_retrieval(cls, corpus: Path | None, info) -> Path | None:
        if corpus is not None and not info.data.get("retrieval"):
            raise ValueError("a corpus is only used with retrieval on")
        return corpus
