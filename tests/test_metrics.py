"""GET /metrics: Prometheus text for the whole service, from what the workers recorded."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sse import MODEL, chat_body, stream_chat
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)


def scrape(service):
    response = httpx.get(f"{service.url}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted({"model": MODEL, **labels}.items()))), 0)


def test_a_request_shows_up_in_every_family(live_service, api_key):
    before = scrape(live_service)
    body = chat_body("Count to five.", max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
    usage = stream_chat(live_service, api_key, body)[-2][1]["usage"]
    after = scrape(live_service)
    assert value(after, "tokstream_prompt_tokens_total") - value(before, "tokstream_prompt_tokens_total") == usage["prompt_tokens"]
    assert value(after, "tokstream_completion_tokens_total") - value(before, "tokstream_completion_tokens_total") == usage["completion_tokens"]
    assert value(after, "tokstream_requests_total", outcome="length") == value(before, "tokstream_requests_total", outcome="length") + 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_time_seconds"):
        name = f"tokstream_{histogram}_count"
        assert value(after, name) == value(before, name) + 1, histogram
    gaps = "tokstream_inter_token_latency_seconds_count"
    assert value(after, gaps) - value(before, gaps) >= 3  # one per gap between streamed outputs
    assert value(after, "tokstream_inter_token_latency_seconds_bucket", le="+Inf") == value(after, gaps)
    assert ("tokstream_requests_running", (("model", MODEL),)) in after


def test_prompt_lookup_drafts_and_their_acceptance_are_counted(live_service, api_key):
    before = scrape(live_service)
    copying = "Repeat this list exactly, one item per line: apples, pears, plums, cherries, lemons, limes, figs, dates."
    stream_chat(live_service, api_key, chat_body(copying, max_tokens=40, temperature=0, stream=True))

    def counted():  # the worker adds them with its heartbeat, every TOKSTREAM_WORKER_TTL / 3
        after = scrape(live_service)
        kept = value(after, "tokstream_draft_tokens_kept_total") - value(before, "tokstream_draft_tokens_kept_total")
        drafted = value(after, "tokstream_draft_tokens_total") - value(before, "tokstream_draft_tokens_total")
        return 0 < kept <= drafted

    eventually(counted, 20, message="no drafts counted")
