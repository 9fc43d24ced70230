"""The chat page on a phone (390×844, touch) in headless Chromium, against the live service:
nothing scrolls sideways, a message is typed, sent with a tap and streamed, and the chat list is
a drawer from which a chat is picked."""

import pytest
from django.contrib.auth import get_user_model

from inference.models import Chat
from tests.test_chat_page import REPLY, Browser

pytestmark = pytest.mark.django_db(transaction=True)
PHONE = {"viewport": {"width": 390, "height": 844}, "has_touch": True, "is_mobile": True, "device_scale_factor": 3}
# Every control on screen that a finger may tap: (what, its height) for those under 44 px.
SMALL_TARGETS = """() => [...document.querySelectorAll('button, a, select, summary, input')]
  .filter((e) => e.offsetParent !== null && getComputedStyle(e).visibility !== 'hidden')
  .map((e) => [e.id || e.className || e.tagName, e.getBoundingClientRect()])
  .filter(([, box]) => box.width > 0 && box.right > 0 && box.left < innerWidth && box.height < 44)
  .map(([name, box]) => `${name}: ${Math.round(box.height)}`)"""


def page_width(page):
    return page.evaluate("() => document.documentElement.scrollWidth")


def send_by_tap(page, text):
    page.tap("summary")  # the parameters
    page.select_option("#model", "echo")
    page.tap("summary")
    page.fill("#prompt", text)
    page.tap("#send")


def test_a_phone_sends_with_a_tap_streams_and_picks_a_chat_from_the_drawer(live_service, new_page):
    get_user_model().objects.create_user("reader", password="pw-for-tests-only")
    browser = Browser(new_page(**PHONE), live_service.url)
    page = browser.page
    assert page_width(page) <= 390 and page.locator("#chats").bounding_box()["x"] < 0  # the list waits in its drawer
    send_box = page.locator("#send").bounding_box()
    assert send_box["x"] + send_box["width"] <= 390 and send_box["height"] >= 44
    assert page.evaluate(SMALL_TARGETS) == []

    send_by_tap(page, "First from a phone, with a long word: " + "supercalifragilistic" * 4)
    browser.wait_until_done()
    assert browser.reply_text().startswith("First from a phone") and page_width(page) <= 390
    assert page.evaluate(SMALL_TARGETS) == []  # the reply's own buttons too
    first = Chat.objects.get()
    page.goto(f"{live_service.url}/")  # a new chat
    send_by_tap(page, "Second from a phone")
    browser.wait_until_done()

    page.tap("#drawer-toggle")
    page.wait_for_function("() => document.querySelector('#chats').getBoundingClientRect().x >= 0")
    assert page.get_attribute("#drawer-toggle", "aria-expanded") == "true"
    page.tap(f"#chats a[href='/c/{first.pk}']")
    page.wait_for_url(f"**/c/{first.pk}")
    page.wait_for_selector(f"{REPLY}[data-finish-reason]")
    assert browser.reply_text().startswith("First from a phone") and page_width(page) <= 390
    assert browser.errors == []
