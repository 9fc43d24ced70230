"""The chat page's conversations endpoints: refusals in the OpenAI error shape that leave
nothing behind, ownership, and the history a reply is asked with."""

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from billing.models import UsageEntry
from inference import streamlog
from inference.chat import conversations as chats
from inference.models import Chat, Turn
from tests.sse import MODEL
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def user():
    return get_user_model().objects.create_user("writer", password="pw")


@pytest.fixture
def client(user):
    client = Client()
    client.force_login(user)
    return client


def post(client, url, status, **body):
    response = client.post(url, body, content_type="application/json")
    assert response.status_code == status, response.content
    return response.json()


def assert_error(answer, param=None, code=None):
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    assert answer["error"]["param"] == param
    if code:
        assert answer["error"]["code"] == code


@pytest.fixture
def nothing_written(redis_client):
    """After the test: no chat, no turn, and no request log in Redis that was not there before."""
    logs = lambda: set(redis_client.scan_iter(match=streamlog.key("*", "log")))  # noqa: E731
    before = logs()
    yield
    assert Chat.objects.count() == 0 and Turn.objects.count() == 0
    assert logs() - before == set()


def test_it_refuses_an_empty_message_and_writes_nothing(client, live_service, nothing_written):
    assert_error(post(client, "/api/chats/messages", 400, content="  ", model=MODEL), param="content")


def test_it_refuses_an_unknown_model_and_writes_nothing(client, live_service, nothing_written):
    assert_error(post(client, "/api/chats/messages", 404, content="hi", model="no-such-model"), param="model", code="model_not_found")


def test_it_refuses_tools_that_are_not_a_list_of_functions(client, live_service, nothing_written):
    answer = post(client, "/api/chats/messages", 400, content="hi", model=MODEL, tools={"name": "x"})
    assert answer["error"]["param"].startswith("tools")


def test_it_refuses_a_body_that_is_not_an_object(client):
    response = client.post("/api/chats/messages", "[1, 2]", content_type="application/json")
    assert response.status_code == 400
    assert_error(response.json())


def test_another_users_chat_does_not_exist_for_you(client, live_service):
    other = get_user_model().objects.create_user("other", password="pw")
    chat = Chat.objects.create(user=other, title="theirs")
    assert_error(post(client, f"/api/chats/{chat.pk}/messages", 404, content="hi", model=MODEL), param="chat")
    assert client.get(f"/api/chats/{chat.pk}").status_code == 404
    assert client.get(f"/c/{chat.pk}").status_code == 404
    assert chat.turns.count() == 0


def test_a_post_without_the_csrf_token_is_refused(user):
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    response = client.post("/api/chats/messages", {"content": "hi", "model": MODEL}, content_type="application/json")
    assert response.status_code == 403
    assert Chat.objects.count() == 0


def test_the_page_needs_a_signed_in_user():
    response = Client().get("/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


def wait_until_settled(turn, seconds=30):
    def settled():
        turn.refresh_from_db()
        return not turn.streaming and turn

    return eventually(settled, seconds, interval=0.1, message="the reply was not settled")


def test_a_second_message_waits_for_the_reply_and_then_carries_the_history(client, live_service):
    first = post(client, "/api/chats/messages", 200, content="one two three " * 30, model="echo", system_prompt="Be brief.")
    chat_id = first["chat"]["id"]
    answer = post(client, f"/api/chats/{chat_id}/messages", 409, content="again", model="echo")
    assert_error(answer, code="reply_in_progress")
    reply = wait_until_settled(Turn.objects.get(pk=first["turns"][1]["id"]))
    assert reply.content == "one two three " * 30 and reply.finish_reason == "stop"
    post(client, f"/api/chats/{chat_id}/messages", 200, content="again", model="echo")
    chat = Chat.objects.get(pk=chat_id)
    assert chats.messages_of(chat)[:3] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one two three " * 30},
        {"role": "assistant", "content": "one two three " * 30},
    ]
    assert chat.title == " ".join(("one two three " * 30).split())[:79] + "…"


def test_regenerate_needs_a_finished_reply(client, user, live_service):
    chat = Chat.objects.create(user=user, title="empty")
    assert_error(post(client, f"/api/chats/{chat.pk}/regenerate", 409, model="echo"), code="nothing_to_regenerate")


def test_a_reply_without_text_is_left_out_of_the_history(user):
    chat = Chat.objects.create(user=user, title="t")
    Turn.objects.create(chat=chat, role="user", content="first")
    Turn.objects.create(chat=chat, role="assistant", content="", finish_reason="cancelled")
    Turn.objects.create(chat=chat, role="user", content="second")
    assert chats.messages_of(chat, "third") == [
        {"role": "user", "content": "first"}, {"role": "user", "content": "second"}, {"role": "user", "content": "third"},
    ]  # fmt: skip


def test_the_endpoints_answer_a_stranger_and_a_wrong_method_in_the_error_shape(client):
    anonymous = Client().post("/api/chats/messages", {"content": "hi"}, content_type="application/json")
    assert anonymous.status_code == 401
    assert_error(anonymous.json(), code="not_signed_in")
    wrong = client.get("/api/chats/messages")
    assert wrong.status_code == 405
    assert_error(wrong.json(), code="method_not_allowed")
    not_a_chat = client.post("/api/chats/count", {"chat": "x", "content": "hi", "model": MODEL}, content_type="application/json")
    assert not_a_chat.status_code == 404
    assert_error(not_a_chat.json(), param="chat")


def test_editing_the_last_message_replaces_it_and_its_reply_and_the_ledger_keeps_every_entry(client, live_service):
    first = post(client, "/api/chats/messages", 200, content="First question", model="echo")
    chat_id = first["chat"]["id"]
    wait_until_settled(Turn.objects.get(pk=first["turns"][1]["id"]))
    second = post(client, f"/api/chats/{chat_id}/messages", 200, content="Second question", model="echo")
    wait_until_settled(Turn.objects.get(pk=second["turns"][1]["id"]))
    edited = post(client, f"/api/chats/{chat_id}/edit", 200, content="Second, edited", model="echo", temperature=0.5)
    assert [t["role"] for t in edited["turns"]] == ["user", "assistant"] and edited["events_url"]
    reply = wait_until_settled(Turn.objects.get(pk=edited["turns"][1]["id"]))
    assert reply.content == "Second, edited"
    chat = Chat.objects.get(pk=chat_id)
    assert [t.content for t in chat.turns.all()] == ["First question", "First question", "Second, edited", "Second, edited"]
    assert chat.settings == {"model": "echo", "temperature": 0.5}
    requests = [first["request_id"], second["request_id"], edited["request_id"]]
    eventually(lambda: UsageEntry.objects.filter(request_id__in=requests).count() == 3, 15, message="the three replies' ledger entries")
    assert not Turn.objects.filter(request_id=second["request_id"]).exists()


def test_an_edit_is_refused_in_the_error_shape_and_changes_nothing(client, user, live_service):
    empty = Chat.objects.create(user=user, title="empty")
    assert_error(post(client, f"/api/chats/{empty.pk}/edit", 409, content="hi", model="echo"), code="nothing_to_edit")
    first = post(client, "/api/chats/messages", 200, content="word " * 200, model="echo")
    chat_id = first["chat"]["id"]
    assert_error(post(client, f"/api/chats/{chat_id}/edit", 409, content="hi", model="echo"), code="reply_in_progress")
    wait_until_settled(Turn.objects.get(pk=first["turns"][1]["id"]))
    assert_error(post(client, f"/api/chats/{chat_id}/edit", 400, content="  ", model="echo"), param="content")
    assert_error(post(client, f"/api/chats/{chat_id}/edit", 400, content="hi", model="echo", temperature=5), param="temperature")
    assert_error(post(client, f"/api/chats/{chat_id}/edit", 404, content="hi", model="no-such-model"), param="model", code="model_not_found")
    other = get_user_model().objects.create_user("other", password="pw")
    theirs = Chat.objects.create(user=other, title="theirs")
    assert_error(post(client, f"/api/chats/{theirs.pk}/edit", 404, content="hi", model="echo"), param="chat")
    assert [t.content for t in Turn.objects.filter(chat_id=chat_id)] == ["word " * 200, "word " * 200]
