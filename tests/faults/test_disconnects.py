"""Thirty clients that leave half a second in: every request cancelled, every decode slot
free again for the next one."""

import pytest

from inference import streamlog
from tests.faults.conftest import holds_back, queue_empty, rows_for
from tests.faults.streams import body, record, record_many
from tests.faults.test_worker_killed import ESSAY
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_disconnect_storm_cancels_everything_and_frees_every_slot(live_service, budgeted, redis_client):
    _, key, budget = budgeted
    gone = record_many(live_service.url, key, [body(ESSAY, max_tokens=600)] * 30, leave_after=0.5)
    ids = [s.request_id for s in gone]
    assert all(ids) and not any(s.done for s in gone)
    rows = rows_for(ids, seconds=60)
    assert all(len(found) == 1 and found[0].status == "cancelled" for found in rows.values())
    assert sum(found[0].completion_tokens for found in rows.values()) < 30 * 600 / 4  # they stopped early
    assert holds_back(budget) and queue_empty(redis_client)
    assert engines_idle(redis_client)
    following = record(live_service.url, key, body("Name a fruit.", max_tokens=8))
    assert following.done and following.queue_position == 0 and following.text


def engines_idle(client, seconds=30):
    """The workers' heartbeats say nothing runs or waits (they beat every few seconds)."""

    def idle():
        beats = streamlog.live_beats(streamlog.workers(client))
        return beats and all(beat.running == 0 and beat.waiting == 0 for beat in beats)

    return eventually(idle, seconds, interval=0.5, message=lambda: f"engines still busy: {streamlog.workers(client)}")
