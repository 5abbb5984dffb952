"""A server-sent event as the services write it: an optional `event:` line, one `data:` line of
JSON, a blank line; what a client's parser reads back is the payload."""

from __future__ import annotations

import json

from common.sse import sse


def parse(stream: str) -> list[tuple[str | None, object]]:
    """(event, payload) of every event of `stream`, as an SSE client reads them."""
    events = []
    for block in stream.split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields.get("event"), json.loads(fields["data"])))
    return events


def test_an_event_is_a_data_line_of_json_ended_by_a_blank_line():
    assert sse({"text": "hi"}) == 'data: {"text": "hi"}\n\n'


def test_a_named_event_has_its_event_line_first():
    assert sse({"n": 1}, event="done") == 'event: done\ndata: {"n": 1}\n\n'


def test_a_newline_in_the_payload_cannot_end_the_event_early():
    payload = {"text": "line one\n\ndata: forged", "tokens": [1, 2]}
    stream = sse(payload) + sse("[DONE]", event="end")
    assert parse(stream) == [(None, payload), ("end", "[DONE]")]
