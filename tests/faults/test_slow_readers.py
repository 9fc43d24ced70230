"""Clients that read one event a second, beside fast ones: the fast ones keep their pace,
and what the web process buffers for the slow ones stays small."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.faults.conftest import rows_for
from tests.faults.streams import body, record, rss_mb

pytestmark = pytest.mark.django_db(transaction=True)
GROWTH_MB = 64  # what 16 slow readers of 32-token replies may cost the web process, at most


def test_slow_readers_do_not_hold_up_fast_ones(live_service, api_key):
    daphne = live_service.children[-1]
    before = rss_mb(daphne.pid)
    slow = [(body(f"Name {n} animals.", max_tokens=32), 1.0) for n in range(2, 18)]
    fast = [(body(f"Name {n} rivers.", max_tokens=32), 0.0) for n in range(2, 6)]
    payloads = slow + fast
    with ThreadPoolExecutor(len(payloads)) as pool:
        streams = list(pool.map(lambda p: record(live_service.url, api_key, p[0], read_delay=p[1]), payloads))
    slow_streams, fast_streams = streams[:16], streams[16:]
    assert all(s.done and s.error is None for s in streams)
    slowest_fast = max(s.ended_at - s.started for s in fast_streams)
    quickest_slow = min(s.ended_at - s.started for s in slow_streams)
    assert slowest_fast < quickest_slow / 2, (slowest_fast, quickest_slow)
    rows = rows_for([s.request_id for s in streams], seconds=10)
    assert all(found[0].completion_tokens == s.usage["completion_tokens"] for s, found in zip(streams, rows.values()))
    assert rss_mb(daphne.pid) - before < GROWTH_MB
