"""What people expect of a chat page, in headless Chromium against the live service: Copy on a
reply and on a code block (read back from the real clipboard), edit-and-resend of the last
message, a refused send or regenerate shown in an alert whose Retry does it again, and a reply
that waits for a slot saying where it stands."""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.conf import settings

from billing.models import UsageEntry
from inference.models import Chat, Turn
from tests.sse import auth, events
from tests.test_chat_page import REPLY, chat_page
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
FENCE = "```"
READ_CLIPBOARD = "() => navigator.clipboard.readText()"


def reply_done(page, text, not_turn=None):
    """Until the last reply has ended with `text` and its numbers (and is not turn `not_turn`)."""
    page.wait_for_function(
        """([text, notTurn]) => {
          const reply = document.querySelector('.turn.assistant:last-of-type');
          return reply?.dataset.text === text && reply.dataset.turnId !== notTurn && reply.querySelector('.meta .usage');
        }""",
        arg=[text, not_turn],
        timeout=60_000,
    )


def test_copy_puts_a_code_block_s_code_and_a_reply_s_markdown_on_the_clipboard(live_service, new_page):
    browser = chat_page(new_page, live_service.url)
    page = browser.page
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=live_service.url)
    code = "for n in range(3):\n    print(n)\n"
    message = f"Run **this**:\n\n{FENCE}python\n{code}{FENCE}\n\nThen look."
    browser.send(message, model="echo")
    reply_done(page, message)
    assert copied(page, f"{REPLY} .copy-code") == code
    assert copied(page, f"{REPLY} .copy-reply") == message
    page.reload()
    assert copied(page, f"{REPLY} .copy-reply") == message  # a saved reply has the same buttons
    assert copied(page, f"{REPLY} .copy-code") == code
    assert browser.errors == []


def copied(page, button):
    """What clicking `button` put on the clipboard, once it says so."""
    page.evaluate("() => navigator.clipboard.writeText('')")
    page.click(button)
    page.wait_for_selector(f"{button} >> text=Copied")
    return page.evaluate(READ_CLIPBOARD)


def user_texts(page):
    return [text.strip() for text in page.locator(".turn.user .body").all_text_contents()]


def reply_texts(page):
    return [text.strip() for text in page.locator(".turn.assistant .body").all_text_contents()]


def test_the_last_message_is_edited_and_sent_again_in_place_of_it_and_its_reply(live_service, new_page):
    browser = chat_page(new_page, live_service.url)
    page = browser.page
    browser.send("First question", model="echo")
    reply_done(page, "First question")
    browser.send("Second question", model="echo")
    reply_done(page, "Second question")
    assert page.locator(".turn.user .edit").count() == 1  # on the last message only
    page.locator(".turn.user").last.locator(".edit").click()
    assert page.input_value("#prompt") == "Second question" and page.is_visible("#editing")
    page.fill("#prompt", "Second question, edited")
    page.press("#prompt", "Enter")
    reply_done(page, "Second question, edited")
    expected = ["First question", "Second question, edited"]
    assert user_texts(page) == expected and reply_texts(page) == expected
    assert not page.is_visible("#editing")
    chat = Chat.objects.get()
    assert [t.content for t in chat.turns.all()] == ["First question", "First question", "Second question, edited", "Second question, edited"]
    page.reload()
    page.wait_for_selector(f"{REPLY} .meta .usage")
    assert user_texts(page) == expected and reply_texts(page) == expected
    # The replaced reply's ledger entry stays: three replies were written, two are in the chat.
    entries = UsageEntry.objects.filter(model="echo")
    eventually(lambda: entries.count() == 3, 15, message="the three replies' ledger entries")
    kept = set(Turn.objects.filter(role="assistant").values_list("request_id", flat=True))
    assert len(kept) == 2 and kept < set(entries.values_list("request_id", flat=True))
    assert browser.errors == []


def refusal(live_service, api_key, **body):
    """The API's own error message for this request: the page must show the same words."""
    request = {"model": "echo", "messages": [{"role": "user", "content": "x"}], "stream": True, **body}
    answer = httpx.post(f"{live_service.url}/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]["message"]


def set_temperature(page, value):
    page.click("summary")
    page.fill("#temperature", value)
    page.click("summary")


def test_a_refused_send_shows_the_server_s_error_in_an_alert_and_retry_sends_it(live_service, new_page, api_key):
    browser = chat_page(new_page, live_service.url)
    page = browser.page
    browser.send("A first message", model="echo")
    reply_done(page, "A first message")
    assert not page.is_visible("#alert")
    browser.send("A second message", model="echo", temperature="5")
    page.wait_for_selector("#alert", state="visible")
    assert page.get_attribute("#alert", "role") == "alert"
    assert page.text_content("#alert-text") == f"Not sent: {refusal(live_service, api_key, temperature=5)}"
    assert page.is_visible(".regenerate") and page.is_visible("#retry")
    assert page.input_value("#prompt") == "A second message"  # nothing typed is lost
    assert user_texts(page) == ["A first message"]
    set_temperature(page, "0.3")
    page.click("#retry")
    reply_done(page, "A second message")
    assert not page.is_visible("#alert")
    assert user_texts(page) == ["A first message", "A second message"]

    set_temperature(page, "5")
    old_reply = page.get_attribute(REPLY, "data-turn-id")
    page.click(".regenerate")
    page.wait_for_selector("#alert", state="visible")
    assert page.text_content("#alert-text").startswith("Not regenerated: ")
    assert page.is_visible(".regenerate") and reply_texts(page) == ["A first message", "A second message"]
    set_temperature(page, "0.3")
    page.click("#retry")
    reply_done(page, "A second message", not_turn=old_reply)
    assert not page.is_visible("#alert") and reply_texts(page) == ["A first message", "A second message"]
    assert Turn.objects.filter(role="assistant").exclude(pk=old_reply).count() == 2
    # The refusals reach the console as failed loads (400); nothing on the page itself failed.
    assert [error for error in browser.errors if "status of 400" not in error] == []


def test_on_a_desktop_a_long_conversation_scrolls_and_never_squeezes_the_settings_line(live_service, new_page):
    from django.contrib.auth import get_user_model

    from tests.test_chat_page import Browser

    user = get_user_model().objects.create_user("reader", password="pw-for-tests-only")
    chat = Chat.objects.create(user=user, title="long")
    for n in range(30):
        Turn.objects.create(chat=chat, role="user", content=f"Question {n}: " + "a long line of words " * 20)
        Turn.objects.create(chat=chat, role="assistant", content=f"Answer {n}.\n\n" + "a paragraph of reply " * 30, finish_reason="stop")
    page = Browser(new_page(viewport={"width": 1280, "height": 800}), live_service.url).page
    height = "() => document.querySelector('.settings summary').getBoundingClientRect().height"
    empty = page.evaluate(height)
    page.goto(f"{live_service.url}/c/{chat.pk}")
    page.wait_for_selector(".turn.assistant")
    assert page.evaluate(height) == empty and empty >= 24
    assert page.evaluate("() => document.querySelector('#log').scrollHeight > document.querySelector('#log').clientHeight")


WATCH_STATUS = """() => {
  window.__statuses = [];
  new MutationObserver(() => window.__statuses.push(document.querySelector('#status').textContent))
    .observe(document.querySelector('#status'), {childList: true, characterData: true, subtree: true});
}"""


def test_a_reply_that_waits_for_a_slot_says_its_place_in_line_then_that_its_prompt_is_read(live_service, new_page, api_key):
    """Every decode slot busy (TOKSTREAM_MAX_RUNNING as shipped) and two API requests queued
    before it: the page says "3rd in line", then "reading your prompt", then generates. The API
    streams that waited too never see a place in line (only their opening's queue_position)."""
    words = " ".join(f"word{n}" for n in range(300))  # about 5 s of the echo model at 15 ms a token
    body = {"model": "echo", "messages": [{"role": "user", "content": words}], "max_tokens": 400, "stream": True}
    running, admitted = threading.Semaphore(0), threading.Semaphore(0)

    def ask(_):
        chunks = []
        with httpx.stream("POST", f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=120) as response:
            admitted.release()
            for _, data in events(response):
                chunks.append(data)
                if len(chunks) == 2:  # the opening, then the first text
                    running.release()
        return chunks

    browser = chat_page(new_page, live_service.url)
    page = browser.page
    slots = settings.TOKSTREAM_MAX_RUNNING
    with ThreadPoolExecutor(slots + 2) as pool:
        fillers = [pool.submit(ask, n) for n in range(slots)]
        for _ in range(slots):
            assert running.acquire(timeout=60), "the slots did not fill"
        queued = [pool.submit(ask, n) for n in range(2)]
        for _ in range(slots + 2):
            assert admitted.acquire(timeout=30)
        page.evaluate(WATCH_STATUS)
        browser.send("Am I in line?", model="echo")
        browser.wait_until_done()
        streams = [future.result() for future in fillers + queued]
    statuses = page.evaluate("window.__statuses")
    in_line = [i for i, status in enumerate(statuses) if status.endswith(" in line")]
    assert in_line and statuses[in_line[0]] == "3rd in line", statuses
    assert statuses[in_line[-1] + 1 :] == ["reading your prompt", "generating", "done"], statuses
    assert browser.reply_text().strip() == "Am I in line?"
    for chunks in streams:
        assert chunks[-1] == "[DONE]" and [c for c in chunks[1:-1] if "tokstream" in c] == []
    assert browser.errors == []
