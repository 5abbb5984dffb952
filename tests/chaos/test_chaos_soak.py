"""A one-minute chaos soak (soak.py, real processes on 127.0.0.1): engines and Redis killed with
SIGKILL and SSD bits flipped under 8 closed-loop clients, and nothing wrong comes out."""

from __future__ import annotations

import pytest

from tests.chaos.soak import SoakConfig, run_soak, table

# 60 s: engines killed at 20 s and 40 s, Redis at 45 s, a bit flipped every 5 s. Fewer
# questions than the bench, so that taking their reference answers stays short.
SHORT_SOAK = SoakConfig(duration_s=60.0, max_questions=8, long_questions=2)


# Five processes start, and an engine restarts twice: on 2 busy cores that takes minutes.
@pytest.mark.timeout(1800)
def test_a_minute_of_kills_and_bit_flips_fails_only_requests_in_flight_and_leaves_redis_clean(
    tmp_path,
):
    report = run_soak(SHORT_SOAK, tmp_path / "soak")
    summary = table(report)
    # The second engine kill is skipped when the first engine is still restarting.
    assert report.engine_kills + report.engine_kills_skipped == 2, summary
    assert report.engine_kills >= 1 and report.redis_kills == 1, summary
    assert report.bit_flips >= 1 and not report.restart_failures, report.restart_failures
    # A 5xx, or a stream cut after its 200, only for a request an engine was killed under.
    assert not report.unexpected, "\n".join([summary, *report.unexpected[:10]])
    assert report.unclean_streams == 0, summary  # every cut stream ended with `event: error`
    assert report.full_prefill_answers > 0 and report.full_prefill_wrong == 0, summary
    assert report.cacheblend_all_cached > 0 and report.cacheblend_wrong == 0, summary
    assert (report.redis_end.poison, report.redis_end.orphans) == (0, 0), summary
    # The audits saw the tier in use (after the Redis kill, warm engines may write nothing).
    assert report.seen_before_redis_kills.entries + report.redis_end.entries > 0, summary
