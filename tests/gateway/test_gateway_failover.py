"""The failover rules (pure functions, no processes): what an engine's status means, which
misses mark an engine down, cost the request's one retry or end the attempts, the client's
status and Retry-After, and the first event's deadline."""

from __future__ import annotations

import pytest

from common.contract import QUEUE_ESTIMATE_HEADER
from gateway.failover import (
    Miss,
    after_miss,
    announced_queue_estimate_s,
    final_status,
    first_event_deadline_s,
    miss_of_status,
    soonest_retry_after_s,
)


@pytest.mark.parametrize("miss", [Miss.UNREACHABLE, Miss.NOT_READY, Miss.BUSY])
def test_an_engine_that_never_started_on_the_request_costs_no_retry(miss):
    verdict = after_miss(miss, streaming_others=False, retried=True)
    assert verdict.try_next and verdict.retried


def test_a_busy_engine_spills_the_request_and_stays_in_the_rotation():
    verdict = after_miss(Miss.BUSY, streaming_others=False, retried=False)
    assert verdict.try_next and not verdict.retried and not verdict.mark_down


@pytest.mark.parametrize("miss", [Miss.SLOW, Miss.FAILED])
def test_a_second_engine_that_took_the_request_and_missed_ends_the_attempts(miss):
    first = after_miss(miss, streaming_others=False, retried=False)
    assert first.try_next and first.retried
    assert not after_miss(miss, streaming_others=False, retried=first.retried).try_next


def test_a_slow_engine_is_marked_down_unless_it_streams_other_requests():
    assert after_miss(Miss.SLOW, streaming_others=False, retried=False).mark_down
    assert not after_miss(Miss.SLOW, streaming_others=True, retried=False).mark_down


def test_only_an_unreachable_or_silent_engine_is_marked_down():
    marked = {m for m in Miss if after_miss(m, streaming_others=False, retried=False).mark_down}
    assert marked == {Miss.UNREACHABLE, Miss.SLOW}


@pytest.mark.parametrize(
    ("misses", "status"),
    [
        ([Miss.FAILED], 502),
        ([Miss.UNREACHABLE, Miss.FAILED], 502),
        ([Miss.SLOW, Miss.FAILED], 502),
        ([Miss.SLOW], 504),
        ([Miss.UNREACHABLE, Miss.SLOW], 504),
        ([Miss.BUSY, Miss.BUSY], 429),
        ([Miss.BUSY, Miss.UNREACHABLE], 429),
        ([Miss.UNREACHABLE, Miss.NOT_READY], 503),
        ([Miss.UNREACHABLE], 503),
    ],
)
def test_the_client_status_once_no_engine_answered(misses, status):
    assert final_status(misses) == status


def test_the_deadline_counts_the_queue_and_the_requests_own_prefill():
    deadline_s = first_event_deadline_s(10.0, 2.0, 4_000, 8_192, 1_000.0)
    assert deadline_s == pytest.approx(10.0 + 2.0 + 4.0)


def test_the_own_prefill_is_bounded_by_the_engines_context():
    deadline_s = first_event_deadline_s(10.0, 0.0, 1_000_000, 8_192, 1_000.0)
    assert deadline_s == pytest.approx(10.0 + 8.192)


def test_an_unmeasured_prefill_speed_adds_nothing():
    assert first_event_deadline_s(10.0, 1.5, 4_000, None, None) == 11.5


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("2.5", 2.5),
        ("0", 0.0),
        (None, None),
        ("-1", None),
        ("nan", None),
        ("inf", None),
        ("soon", None),
    ],
)
def test_only_a_finite_non_negative_announced_queue_wait_replaces_the_polled_one(value, seconds):
    headers = {} if value is None else {QUEUE_ESTIMATE_HEADER: value}
    assert announced_queue_estimate_s(headers) == seconds


@pytest.mark.parametrize(
    ("status", "miss"),
    [(503, Miss.NOT_READY), (429, Miss.BUSY), (500, Miss.FAILED), (502, Miss.FAILED)],
)
def test_an_engines_refusal_is_a_miss_that_may_go_to_the_next_engine(status, miss):
    assert miss_of_status(status) is miss


@pytest.mark.parametrize("status", [200, 400, 404, 413, 422])
def test_a_success_or_a_request_error_is_no_miss(status):
    assert miss_of_status(status) is None


def test_a_request_every_engine_refused_is_retried_after_the_soonest_wait():
    assert soonest_retry_after_s(["5", None, "2", "soon"]) == "2"
    assert soonest_retry_after_s([None, "later"]) == "1"
