"""Clients that read two events a second, beside fast ones: the fast ones keep their pace,
and what the web process buffers for the slow ones stays small."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.faults.conftest import rows_for
from tests.faults.streams import body, record, rss_mb

pytestmark = pytest.mark.django_db(transaction=True)
GROWTH_MB = 64  # what 16 slow readers of 32-token replies may cost the web process, at most
FAST_LAG = 2.0  # seconds from a reply's end in the ledger to [DONE] at a client that keeps up
# A reader taking half a second an event finishes well after the engine did (its ~25 events
# take ~12 s; the engine needs a few seconds a reply), unless the engine waited for it.
SLOW_LAG = 5.0
SLOW_READ = 0.5  # seconds a slow reader waits before each next event


def test_slow_readers_do_not_hold_up_fast_ones(live_service, api_key):
    daphne = live_service.children[-1]
    before = rss_mb(daphne.pid)
    slow = [(body(f"Name {n} animals.", max_tokens=32), SLOW_READ) for n in range(2, 18)]
    fast = [(body(f"Name {n} rivers.", max_tokens=32), 0.0) for n in range(2, 6)]
    payloads = slow + fast
    with ThreadPoolExecutor(len(payloads)) as pool:
        streams = list(pool.map(lambda p: record(live_service.url, api_key, p[0], read_delay=p[1]), payloads))
    slow_streams, fast_streams = streams[:16], streams[16:]
    assert all(s.done and s.error is None for s in streams)
    rows = rows_for([s.request_id for s in streams], seconds=10)
    finished = {s.request_id: rows[s.request_id][0].finished_at.timestamp() for s in streams}
    assert all(rows[s.request_id][0].completion_tokens == s.usage["completion_tokens"] for s in streams)
    # How long after its reply was generated each client had read all of it. Queueing behind
    # the slow ones is the scheduler's business; what a slow reader must not do is make a
    # fast client wait past its own reply's end, or make the engine wait for the reader.
    wall = time.time() - time.monotonic()
    lag = {s.request_id: s.ended_at + wall - finished[s.request_id] for s in streams}
    assert max(lag[s.request_id] for s in fast_streams) < FAST_LAG, lag
    assert min(lag[s.request_id] for s in slow_streams) > SLOW_LAG, lag
    assert rss_mb(daphne.pid) - before < GROWTH_MB
