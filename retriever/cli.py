"""`ragblend retriever` (serve the retriever) and `ragblend ingest PATH...` (send files to
the gateway, or to the retriever when no gateway answers)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.serving import add_settings_flags, serve, settings_from_args
from retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)

GATEWAY_URL = "http://127.0.0.1:8000"
RETRIEVER_URL = "http://127.0.0.1:8001"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    service = subparsers.add_parser(
        "retriever",
        help="run the retriever service",
        description="`ragblend retriever`: serve the retriever over HTTP (settings from flags "
        "or RAGBLEND_RETRIEVER_*).",
    )
    add_settings_flags(service, RetrieverSettings)
    service.set_defaults(run=run_retriever)

    ingest = subparsers.add_parser(
        "ingest",
        help="ingest files or folders (recursively)",
        description="`ragblend ingest PATH...`: extract the text of each file here and post it "
        "to the gateway, or to the retriever when no gateway answers; prints what was "
        "ingested, skipped and failed, and exits 1 when a file failed.",
    )
    ingest.add_argument("paths", nargs="+", metavar="PATH", help="files or folders")
    ingest.add_argument(
        "--url",
        help=f"service to post to (default: the gateway {GATEWAY_URL} if its /health "
        f"answers, else the retriever {RETRIEVER_URL})",
    )
    ingest.add_argument("--metadata", default="{}", help="JSON object added to every document")
    ingest.add_argument("--timeout", type=float, default=600.0, help="seconds per document")
    ingest.set_defaults(run=run_ingest)


def run_retriever(args: argparse.Namespace) -> int:
    from retriever.malloc import limit_malloc_arenas

    limit_malloc_arenas()  # before the model and the worker threads allocate
    from retriever.api.main import create_app

    settings = settings_from_args(RetrieverSettings, args, "retriever")
    return serve(create_app, settings, args, access_log=False)


# -- ingest -----------------------------------------------------------------------------------


@dataclass
class IngestSummary:
    documents: int = 0
    chunks: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    failed: list[tuple[str, str]] = field(default_factory=list)

    def render(self) -> str:
        lines = [
            f"documents: {self.documents}",
            f"chunks: {self.chunks}",
            f"skipped: {sum(self.skipped.values())}",
        ]
        lines += [f"  {count} {reason}" for reason, count in sorted(self.skipped.items())]
        lines.append(f"failed: {len(self.failed)}")
        lines += [f"  {path}: {reason}" for path, reason in self.failed]
        return "\n".join(lines)


def discover(paths: list[str], summary: IngestSummary) -> list[Path]:
    """Files named directly, plus supported files found under folders (recursively)."""
    from retriever.extract import is_supported

    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for found in sorted(p for p in path.rglob("*") if p.is_file()):
                if is_supported(found.name):
                    files.append(found)
                else:
                    summary.skipped["unsupported file type (in a folder)"] += 1
        elif path.is_file():
            files.append(path)  # named explicitly: an unsupported type is a failure
        else:
            summary.failed.append((raw, "no such file or folder"))
    return files


def choose_url(explicit: str | None) -> str:
    import httpx

    if explicit:
        return explicit.rstrip("/")
    try:
        if httpx.get(f"{GATEWAY_URL}/health", timeout=1.0).status_code == 200:
            return GATEWAY_URL
    except httpx.HTTPError:
        pass
    return RETRIEVER_URL


def _error_detail(response: Any) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    text = detail if isinstance(detail, str) else json.dumps(detail)
    return f"HTTP {response.status_code}: {text}"


def run_ingest(args: argparse.Namespace) -> int:
    import httpx
    from tqdm import tqdm

    from retriever.extract import (
        ExtractionError,
        ExtractionLimitError,
        UnsupportedFileTypeError,
        extract_text,
    )

    try:
        extra_metadata = json.loads(args.metadata)
        assert isinstance(extra_metadata, dict)
    except (json.JSONDecodeError, AssertionError):
        print("--metadata must be a JSON object", file=sys.stderr)
        return 2
    summary = IngestSummary()
    files = discover(args.paths, summary)
    url = choose_url(args.url)
    print(f"ingesting {len(files)} file(s) into {url}", file=sys.stderr)
    with httpx.Client(timeout=args.timeout) as client:
        for path in tqdm(files, unit="file", file=sys.stderr):
            # Text is extracted here, with the retriever's own extractor, so that the JSON
            # contract {text, metadata, id} is all a gateway in between has to pass on.
            try:
                extracted = extract_text(path.name, path.read_bytes())
            except (
                UnsupportedFileTypeError,
                ExtractionError,
                ExtractionLimitError,
                OSError,
            ) as exc:
                summary.failed.append((str(path), str(exc)))
                continue
            if not extracted.text.strip():
                summary.failed.append((str(path), "file contains no text"))
                continue
            metadata = {**extracted.metadata, "source": str(path), **extra_metadata}
            try:
                response = client.post(
                    f"{url}/v1/documents", json={"text": extracted.text, "metadata": metadata}
                )
            except httpx.HTTPError as exc:
                summary.failed.append((str(path), f"{url} unreachable: {exc}"))
                continue
            if response.status_code != 200:
                summary.failed.append((str(path), _error_detail(response)))
                continue
            body = response.json()
            if body.get("status") == "unchanged":
                summary.skipped["already ingested (unchanged)"] += 1
            else:
                summary.documents += 1
                summary.chunks += len(body.get("chunk_ids", []))
    print(summary.render())
    return 1 if summary.failed else 0
