"""Whose cached KV a request may reuse: the cache salts the gateway sends the engine, so that
no tenant learns from a fast first token that another holds a text (docs/gateway.md, "Tenancy")."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from gateway.auth import ALL_COLLECTIONS, ApiKey

# per_key: each API key's passages and prompt prefixes apart; per_collections: keys allowed the
# same collections share them; shared: every key shares everything (one tenant).
CacheSharing = Literal["per_key", "per_collections", "shared"]


def salt_of(*parts: str) -> str:
    """A salt on the wire: a hash, so that it names no key or collection and has one length."""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def collection_salt(collection: str) -> str:
    """The salt of a collection's chunks, at ingest (the precompute) and when retrieved: a
    chunk's KV is found only by requests that may read its collection, which retrieval
    enforces."""
    return salt_of("collection", collection)


@dataclass(frozen=True)
class CacheScope:
    """`keyed`: API keys are configured (without them there is one tenant, and only a
    request's own cache_salt scopes anything)."""

    sharing: CacheSharing
    keyed: bool

    @property
    def scoped(self) -> bool:
        return self.keyed and self.sharing != "shared"

    def tenant(self, key: ApiKey | None) -> str:
        if key is None or not self.scoped:
            return ""
        if self.sharing == "per_collections":
            names = ALL_COLLECTIONS if key.collections is None else sorted(key.collections)
            return json.dumps(["collections", names])
        return json.dumps(["key", key.name])

    def request_salt(self, key: ApiKey | None, cache_salt: str | None) -> str:
        """The salt of a request's own passages and of its prompt prefix: its tenant's, and
        within it the request's cache_salt (vLLM's field); "" when neither scopes it."""
        tenant = self.tenant(key)
        if not tenant and not cache_salt:
            return ""
        return salt_of("request", tenant, cache_salt or "")

    def collection_salt(self, collection: str) -> str:
        """`collection_salt`, or "" when not scoped (one tenant: as before tenants)."""
        return collection_salt(collection) if self.scoped else ""


# One tenant: nothing scoped (no API keys).
UNSCOPED = CacheScope("shared", keyed=False)
