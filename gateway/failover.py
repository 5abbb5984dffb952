"""The failover rules of a generation as pure functions: the first event's deadline, what one
engine's miss means for the request and for that engine, and the status once every try missed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from common.contract import QUEUE_ESTIMATE_HEADER


class Miss(Enum):
    """How an engine failed a request before its first event."""

    UNREACHABLE = "unreachable"  # no connection: nothing was sent
    NOT_READY = "not_ready"  # 503: up, its model not loaded yet
    BUSY = "busy"  # 429: its pool and queue are full
    SLOW = "slow"  # no first event before the deadline
    FAILED = "failed"  # a 5xx, a broken stream or an error event

    @property
    def took_request(self) -> bool:
        """The engine may have worked on the request, so trying another spends the retry."""
        return self in (Miss.SLOW, Miss.FAILED)

    @property
    def metric_kind(self) -> str:
        """The `kind` label of ragblend_gateway_upstream_errors_total."""
        return {
            Miss.UNREACHABLE: "unavailable",
            Miss.NOT_READY: "unavailable",
            Miss.BUSY: "busy",
            Miss.SLOW: "timeout",
            Miss.FAILED: "failed",
        }[self]


@dataclass(frozen=True)
class Verdict:
    mark_down: bool  # leave the rotation until a health probe succeeds
    try_next: bool  # send the request to the next engine of the ranking
    retried: bool  # the request's one retry is spent (now or before)


def after_miss(miss: Miss, *, streaming_others: bool, retried: bool) -> Verdict:
    """What one miss means. `streaming_others`: the engine delivered events of other streams
    while this request waited, so it is alive and only slow (a long prefill, a queue longer
    than its estimate): it stays in the rotation. An engine that took the request and missed
    spends the one retry; a second such miss ends the attempts, which bounds the client's wait
    to two deadlines. Unreachable, not-ready and busy engines never started on the request:
    they cost no retry, so a busy engine spills the request over the whole ranking."""
    mark_down = miss is Miss.UNREACHABLE or (miss is Miss.SLOW and not streaming_others)
    try_next = not (miss.took_request and retried)
    return Verdict(mark_down, try_next, retried or miss.took_request)


def miss_of_status(status: int) -> Miss | None:
    """What an engine's HTTP status before its stream means: 503 its model is not loaded yet,
    429 its pool and queue are full, another 5xx a failure. None for a success, and for any
    other 4xx: the request would fare no better on another engine, so it is answered as is."""
    if status == 503:
        return Miss.NOT_READY
    if status == 429:
        return Miss.BUSY
    if status >= 500:
        return Miss.FAILED
    return None


def soonest_retry_after_s(retry_after: list[str | None]) -> str:
    """The Retry-After of a request every engine refused as busy: the soonest any of them
    expects room, in whole seconds (1 when none said)."""
    waits = [int(value) for value in retry_after if (value or "").isdigit()]
    return str(min(waits, default=1))


def final_status(misses: list[Miss]) -> int:
    """The client's status once no engine answered: 502 when one failed on the request, else
    504 when one was too slow, else 429 when one was busy (every engine that is up refused),
    else 503 (no engine available)."""
    assert misses, "a request that no engine missed was answered"
    for miss, status in ((Miss.FAILED, 502), (Miss.SLOW, 504), (Miss.BUSY, 429)):
        if miss in misses:
            return status
    return 503


def first_event_deadline_s(
    ttft_timeout_s: float,
    queue_estimate_s: float,
    prompt_bytes: int,
    max_model_len: int | None,
    prefill_tokens_per_s: float | None,
) -> float:
    """How long an engine gets for the first event: the base timeout, the wait its queue
    estimate announces, and the request's own prefill at the engine's measured throughput. The
    prompt's token count is bounded by its UTF-8 bytes (a byte-level BPE token covers at least
    one byte) and by the engine's context (it drops chunks to fit): an upper bound, so a long
    prefill is never taken for a hung engine. Unmeasured throughput counts as free."""
    own_prefill_s = 0.0
    if prefill_tokens_per_s:
        tokens = prompt_bytes if max_model_len is None else min(prompt_bytes, max_model_len)
        own_prefill_s = tokens / prefill_tokens_per_s
    return ttft_timeout_s + queue_estimate_s + own_prefill_s


def announced_queue_estimate_s(headers: Mapping[str, str]) -> float | None:
    """The queue wait an engine announced as it queued the request (its response header), None
    where it announced none or nothing usable (an older engine: the polled estimate stands)."""
    try:
        value = float(headers.get(QUEUE_ESTIMATE_HEADER, "nan"))
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
