"""Clients that stop reading after their first token and then read two events a second,
beside fast ones: the engine finishes the slow ones' replies without waiting for them, the
fast ones keep their pace, and what the web process buffers for the slow ones stays small."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from billing.models import UsageEntry
from tests.faults.conftest import rows_for
from tests.faults.streams import body, record, rss_mb
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
GROWTH_MB = 64  # what 16 slow readers of 32-token replies may cost the web process, at most
FAST_LAG = 2.0  # seconds from a reply's end in the ledger to [DONE] at a client that keeps up
SLOW_READ = 0.5  # seconds a slow reader waits before each next event
# How long a slow reader stops after its first token, at most, for its reply to be billed: an
# engine that waited for its reader would never finish it. A fixed pace could not tell the two
# apart on a slow machine, where 20 replies at once take as long as a reader of ~25 events.
HOLD_LIMIT = 120


def billed_before_reading_on(stream):
    def billed():
        return UsageEntry.objects.filter(request_id=stream.request_id).exists()

    try:
        eventually(billed, HOLD_LIMIT, interval=0.2, message=f"{stream.request_id} was not billed while its reader held")
    finally:
        connection.close()  # this reader's thread opened it


def test_slow_readers_do_not_hold_up_fast_ones(live_service, api_key):
    daphne = live_service.children[-1]
    before = rss_mb(daphne.pid)
    slow = [(body(f"Name {n} animals.", max_tokens=32), SLOW_READ) for n in range(2, 18)]
    fast = [(body(f"Name {n} rivers.", max_tokens=32), 0.0) for n in range(2, 6)]
    payloads = slow + fast
    with ThreadPoolExecutor(len(payloads)) as pool:
        streams = list(pool.map(lambda p: read_like(live_service.url, api_key, *p), payloads))
    fast_streams = streams[16:]
    assert all(s.done and s.error is None for s in streams)
    rows = rows_for([s.request_id for s in streams], seconds=10)
    finished = {s.request_id: rows[s.request_id][0].finished_at.timestamp() for s in streams}
    assert all(rows[s.request_id][0].completion_tokens == s.usage["completion_tokens"] for s in streams)
    # How long after its reply was generated each fast client had read all of it. Queueing
    # behind the slow ones is the scheduler's business; what a slow reader must not do is make
    # a fast client wait past its own reply's end.
    wall = time.time() - time.monotonic()
    lag = {s.request_id: s.ended_at + wall - finished[s.request_id] for s in fast_streams}
    assert max(lag.values()) < FAST_LAG, lag
    assert rss_mb(daphne.pid) - before < GROWTH_MB


def read_like(url, api_key, payload, read_delay):
    hold = billed_before_reading_on if read_delay else None
    return record(url, api_key, payload, read_delay=read_delay, hold=hold)
