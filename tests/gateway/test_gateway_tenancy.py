"""The cache salts of gateway/tenancy.py and LMCache's prompt convention, as pure functions:
who shares a salt under each cache_sharing, and how a prompt splits on the separator."""

from __future__ import annotations

from gateway.api.rag import split_prompt
from gateway.auth import ApiKey
from gateway.tenancy import CacheScope

ALICE = ApiKey("alice", b"a" * 32, ("a", "b"))
BOB = ApiKey("bob", b"b" * 32, ("b", "a"))
ADMIN = ApiKey("admin", b"c" * 32, None)


def test_per_key_gives_every_key_its_own_salt_and_a_cache_salt_another():
    scope = CacheScope("per_key", keyed=True)
    salts = {scope.request_salt(k, None) for k in (ALICE, BOB, ADMIN)}
    assert len(salts) == 3 and "" not in salts
    assert scope.request_salt(ALICE, "user-1") not in salts | {scope.request_salt(ALICE, "u2")}
    assert scope.request_salt(ALICE, None) == scope.request_salt(ALICE, "")


def test_per_collections_shares_between_keys_allowed_the_same_collections():
    scope = CacheScope("per_collections", keyed=True)
    assert scope.request_salt(ALICE, None) == scope.request_salt(BOB, None)
    assert scope.request_salt(ALICE, None) != scope.request_salt(ADMIN, None)


def test_shared_or_keyless_salts_nothing_but_a_cache_salt():
    for scope in (CacheScope("shared", keyed=True), CacheScope("per_key", keyed=False)):
        assert scope.request_salt(ALICE, None) == scope.request_salt(None, None) == ""
        assert scope.collection_salt("a") == ""
        assert scope.request_salt(None, "user-1") != ""


def test_collections_get_salts_of_their_own_apart_from_any_keys():
    scope = CacheScope("per_key", keyed=True)
    salts = {scope.collection_salt("a"), scope.collection_salt("b")}
    assert len(salts) == 2 and scope.request_salt(ALICE, None) not in salts


def test_a_prompt_splits_into_system_passages_and_question():
    sep = " # # "
    assert split_prompt("sys # # p1 # # p2 # # q?", sep) == ("sys", ["p1", "p2"], "q?")
    assert split_prompt(" # # p1 # #  # # q?", sep) == (None, ["p1"], "q?")
    assert split_prompt("sys # # q?", sep) == ("sys", [], "q?")
    assert split_prompt("no separator here", sep) is None
    assert split_prompt("sys # # p1 # # ", sep) is None  # no question after the last
    assert split_prompt("a # # b", None) is None
