"""The store key of a chunk: the model, the tokens and the cache salt each change it; the empty
salt keeps the key chunks had before salts."""

from __future__ import annotations

import hashlib

import numpy as np

from kvstore.types import chunk_key, is_valid_key

TOKENS = (5, 17, 301)


def test_the_empty_salt_keeps_the_unsalted_key():
    unsalted = hashlib.sha256(b"model-a")
    unsalted.update(np.asarray(TOKENS, dtype=np.int64).tobytes())
    assert chunk_key("model-a", TOKENS) == chunk_key("model-a", TOKENS, "") == unsalted.hexdigest()


def test_each_salt_gives_the_same_tokens_another_valid_key():
    keys = {chunk_key("model-a", TOKENS, salt) for salt in ("", "tenant-a", "tenant-b")}
    assert len(keys) == 3 and all(is_valid_key(k) for k in keys)
    assert chunk_key("model-a", TOKENS, "tenant-a") == chunk_key("model-a", TOKENS, "tenant-a")
    assert chunk_key("model-b", TOKENS, "tenant-a") != chunk_key("model-a", TOKENS, "tenant-a")
