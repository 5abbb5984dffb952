"""The shared field types: safe document ids, encodable text, 64-bit seeds."""

import pytest
from pydantic import BaseModel, ValidationError

from common.validation import DocId, Seed, Text


class Body(BaseModel):
    doc_id: DocId = "a"
    text: Text = ""
    seed: Seed | None = None


@pytest.mark.parametrize("doc_id", ["a", "docs/a.md", ".hidden", "a/.b", "A-1_2:x@y+z"])
def test_safe_doc_ids_are_accepted(doc_id):
    assert Body(doc_id=doc_id).doc_id == doc_id


@pytest.mark.parametrize(
    "doc_id", ["", "..", ".", "a/../x", "../health", "a//b", "/a", "a/", "a/./b", "x y", "a%2F"]
)
def test_ids_that_could_climb_or_do_not_fit_a_path_are_refused(doc_id):
    with pytest.raises(ValidationError):
        Body(doc_id=doc_id)


def test_doc_ids_are_bounded():
    Body(doc_id="a" * 200)
    with pytest.raises(ValidationError):
        Body(doc_id="a" * 201)


def test_lone_surrogates_are_refused():
    with pytest.raises(ValidationError, match="not valid Unicode"):
        Body(text="ok \udc00")


def test_seeds_must_fit_64_bits():
    assert Body(seed=2**63 - 1).seed == 2**63 - 1
    with pytest.raises(ValidationError):
        Body(seed=2**64)
