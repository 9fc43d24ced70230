"""How each reply ended, marked under it from its ledger entry, the same after a reload: completed,
cut at max tokens (with Continue), stopped by its user, cancelled while its page was away (the
shipped TOKSTREAM_ABANDON_SECONDS), failed with its error (tests/test_upstream.py, where a
vendor fails)."""

import pytest
from django.conf import settings

from inference.models import Chat
from tests.service import wait_for_entry
from tests.test_chat_page import LONG, REPLY, Browser, chat_page, wait_for_text

pytestmark = pytest.mark.django_db(transaction=True)


def ending_after_reload(browser):
    """The reply's mark as the page shows it, and again after a reload."""
    page = browser.page
    page.wait_for_selector(f"{REPLY} .meta .ending")
    live = page.text_content(f"{REPLY} .meta .ending")
    page.reload()
    page.wait_for_selector(f"{REPLY} .meta .ending")
    return live, page.text_content(f"{REPLY} .meta .ending")


def test_a_completed_reply_and_one_cut_at_max_tokens_say_so_and_the_cut_one_offers_continue(live_service, new_page):
    browser = chat_page(new_page, live_service.url)
    browser.send("Hello there.", model="echo")
    browser.wait_until_done()
    assert ending_after_reload(browser) == ("Completed", "Completed")
    browser.send("One two three four five six seven eight.", model="echo", max_tokens=3)
    browser.wait_until_done()
    assert ending_after_reload(browser) == ("Cut at the token limit",) * 2
    page = browser.page
    page.click(f"{REPLY} .continue")
    page.wait_for_selector(f"{REPLY} .meta .ending >> text=Completed")
    assert [t.content for t in Chat.objects.get().turns.filter(role="user")][-1] == "Continue."
    assert browser.errors == []


def test_a_stopped_reply_and_one_abandoned_by_its_page_are_told_apart(live_service, new_page):
    browser = chat_page(new_page, live_service.url)
    page = browser.page
    browser.send(LONG, model="echo", max_tokens=4000)
    wait_for_text(page, 30)
    page.click("#stop")
    browser.wait_until_done()
    assert ending_after_reload(browser) == ("Stopped by its user.",) * 2

    page.goto(f"{live_service.url}/")  # a new chat, so its prompt is one message again
    browser.send(LONG, model="echo", max_tokens=4000)
    wait_for_text(page, 30)
    chat_url = page.url
    page.close()  # the tab is closed with the reply still being written
    entry = wait_for_entry(seconds=settings.TOKSTREAM_ABANDON_SECONDS + 30, status="cancelled", error__startswith="Cancelled")
    browser = Browser(new_page(), live_service.url)
    browser.page.goto(chat_url)
    away = f"Cancelled: nobody followed it for {settings.TOKSTREAM_ABANDON_SECONDS} s (its page was closed or away)."
    assert entry.error == away and ending_after_reload(browser) == (away, away)
