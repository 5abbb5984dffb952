"""Server-sent events as the services stream them: an optional `event:` line, then JSON data."""

from __future__ import annotations

import json
from typing import Any


def sse(payload: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n"
