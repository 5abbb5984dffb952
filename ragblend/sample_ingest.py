"""What `ragblend up` does once the stack is ready: ingest the documents folder on first start,
and pick an example question whose source is in the collection for the banner."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ragblend.banner import SampleQuestion, example_question, read_questions

log = logging.getLogger("ragblend.up")


def ingest_samples(gateway_url: str, folder: Path) -> None:
    """Ingest every supported file of `folder` when the collection is empty (first start)."""
    import httpx
    from tqdm import tqdm

    from retriever.extract import (
        ExtractionError,
        ExtractionLimitError,
        extract_text,
        is_supported,
    )

    with httpx.Client(base_url=gateway_url, timeout=600.0) as client:
        if client.get("/v1/documents", params={"limit": 1}).json()["total"] > 0:
            return
        files = sorted(p for p in folder.rglob("*") if p.is_file() and is_supported(p.name))
        failed = 0
        for path in tqdm(files, desc="ingesting sample documents", unit="doc", file=sys.stderr):
            try:
                extracted = extract_text(path.name, path.read_bytes())
            except (ExtractionError, ExtractionLimitError, OSError) as exc:
                failed += 1
                print(f"  {path.name}: {exc}", file=sys.stderr)
                continue
            response = client.post(
                "/v1/documents",
                json={
                    "text": extracted.text,
                    "metadata": {**extracted.metadata, "source": path.name},
                },
            )
            if response.status_code != 200:
                failed += 1
                print(
                    f"  {path.name}: HTTP {response.status_code} {response.text[:200]}",
                    file=sys.stderr,
                )
        if failed:
            print(f"{failed} of {len(files)} sample documents failed", file=sys.stderr)


def ingested_example_question(gateway_url: str, documents: Path) -> SampleQuestion | None:
    """A sample question of `documents` whose source is in the collection now, else None."""
    import httpx

    try:
        questions = read_questions(documents)
    except ValueError as exc:
        log.warning("no example question: %s", exc)
        return None
    if not questions:
        return None
    listed = httpx.get(f"{gateway_url}/v1/documents", params={"limit": 1000}, timeout=30.0)
    sources = {d["metadata"].get("source") for d in listed.json().get("documents", [])}
    return example_question(questions, sources)
