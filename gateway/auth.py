"""Client API keys: who may call the gateway (`Authorization: Bearer <key>`, as OpenAI clients
send it) and which collections each key may use; only SHA-256 hashes of keys are kept."""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator
from starlette.types import ASGIApp, Receive, Scope, Send

from common.auth import bearer_token, send_unauthorized
from common.validation import CollectionName

log = logging.getLogger(__name__)
ALL_COLLECTIONS = "*"
# Probes of load balancers and orchestrators, which carry no key.
OPEN_PATHS = frozenset({"/health", "/ready"})


@dataclass(frozen=True)
class ApiKey:
    """`collections` None: every collection; else the allowed ones, the first the default."""

    name: str
    sha256: bytes
    collections: tuple[str, ...] | None

    def allows(self, collection: str) -> bool:
        return self.collections is None or collection in self.collections


class KeyEntry(BaseModel):
    """One entry of api_keys_file; the key itself or its SHA-256 (hex), so the file need not
    hold the secret."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    key: str | None = Field(None, min_length=1, repr=False)
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    collections: list[Literal["*"] | CollectionName] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_secret(self) -> KeyEntry:
        if (self.key is None) == (self.sha256 is None):
            raise ValueError(f"API key {self.name}: give exactly one of key and sha256")
        return self

    def api_key(self) -> ApiKey:
        digest = _digest(self.key) if self.key is not None else bytes.fromhex(self.sha256 or "")
        every = ALL_COLLECTIONS in self.collections
        return ApiKey(self.name, digest, None if every else tuple(self.collections))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_keys(api_keys: list[str], api_keys_file: Path | None) -> list[ApiKey]:
    """The keys of the settings: `api_keys` (named key-0, key-1…, every collection) and the
    entries of the JSON file. Raises ValueError naming the problem of a bad file."""
    keys = [ApiKey(f"key-{i}", _digest(k), None) for i, k in enumerate(api_keys)]
    if api_keys_file is not None:
        try:
            entries = TypeAdapter(list[KeyEntry]).validate_json(api_keys_file.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"api_keys_file {api_keys_file}: {exc}") from None
        keys += [entry.api_key() for entry in entries]
    return keys


def find_key(keys: list[ApiKey], token: str) -> ApiKey | None:
    given = _digest(token)
    found = None
    for key in keys:  # all compared, in constant time: the time tells nothing of a guess
        if hmac.compare_digest(given, key.sha256):
            found = key
    return found


class ApiKeyMiddleware:
    """With keys configured, every request outside OPEN_PATHS needs a known key (else 401 with
    `WWW-Authenticate: Bearer`); the key (or None without keys) goes to `scope["state"]`."""

    def __init__(self, app: ASGIApp, *, keys: list[ApiKey]):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = None
        if self.keys and scope["path"] not in OPEN_PATHS:
            token = bearer_token(scope)
            key = None if token is None else find_key(self.keys, token)
            if key is None:
                problem = "missing API key" if token is None else "invalid API key"
                log.warning("%s %s refused: %s", scope["method"], scope["path"], problem)
                await send_unauthorized(send, f"{problem}: send Authorization: Bearer <key>")
                return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)
