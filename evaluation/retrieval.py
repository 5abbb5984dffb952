"""Passages for each question from an in-process retriever: every document goes into a fresh
RetrieverService in a temporary folder, then each question takes its top-k chunks."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from evaluation.dataset import Record
from retriever.service import DocumentInput, RetrieverService
from retriever.settings import RetrieverSettings


def corpus_of(records: Sequence[Record]) -> list[str]:
    """Every record's passages, each once, as the documents to retrieve from."""
    return list(dict.fromkeys(p for record in records for p in record.passages))


def retrieve(
    records: Sequence[Record], documents: Sequence[str], top_k: int, progress: bool = True
) -> list[list[str]]:
    """Each record's top-k chunk texts, best first."""
    if not documents:
        raise ValueError("retrieval is on but there are no documents: give passages or a corpus")
    with tempfile.TemporaryDirectory(prefix="ragblend-eval-") as data_dir:
        # The index is saved once, when the service closes.
        settings = RetrieverSettings(data_dir=Path(data_dir), index_save_interval_s=3600.0)
        service = RetrieverService.open(settings)
        try:
            for text in tqdm(documents, desc="ingest", unit="doc", disable=not progress):
                service.ingest(DocumentInput(text))
            return [
                [hit.text for hit in service.search(record.question, top_k)]
                for record in tqdm(records, desc="search", unit="question", disable=not progress)
            ]
        finally:
            service.close()
