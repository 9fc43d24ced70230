"""Several web processes and workers on one Redis: every stream stays whole and in order."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from inference import streamlog
from tests.conftest import separate_service
from tests.reference import reference
from tests.sse import chat_body, content_of, stream_chat

pytestmark = pytest.mark.django_db(transaction=True)
QUESTIONS = ["Name a fruit.", "Name a colour.", "Name a planet.", "Name a tree."]


@pytest.fixture
def two_by_two(django_db_setup, django_db_blocker, redis_client):
    # float32: the replies are compared with transformers' `generate` token for token.
    with separate_service(django_db_blocker, 2, daphnes=2, workers=2, TOKSTREAM_WEIGHTS="float32") as service:
        yield service


def test_sixteen_streams_over_two_web_processes_and_two_workers(two_by_two, api_key, model):
    def ask(n):
        web = SimpleNamespace(url=two_by_two.urls[n % 2])
        return stream_chat(web, api_key, chat_body(QUESTIONS[n % 4], max_tokens=12, temperature=0, stream=True))

    with ThreadPoolExecutor(16) as pool:
        streams = list(pool.map(ask, range(16)))
    for n, streamed in enumerate(streams):
        prompt = model.tokenizer.apply_chat_template(chat_body(QUESTIONS[n % 4])["messages"], add_generation_prompt=True)
        expected = model.tokenizer.decode(reference(model, prompt, 12), skip_special_tokens=True)
        assert content_of(data for _, data in streamed[:-1]) == expected, n
        ids = [event_id for event_id, _ in streamed]
        assert len(set(ids)) == len(ids) and streamed[-1][1] == "[DONE]"
    client = streamlog._sync_client(two_by_two.env["TEST_REDIS_URL"])
    workers = {client.hget(streamlog.key(s[0][1]["id"], "meta"), "worker") for s in streams}
    assert len(workers) == 2  # both workers took a share
