"""The chat page on a phone (390×844, touch) in headless Chromium, against the live service:
nothing scrolls sideways, a message is typed, sent with a tap and streamed, and the chat list is
a drawer from which a chat is picked."""

import pytest
from django.contrib.auth import get_user_model

from inference.models import Chat
from tests.test_chat_page import REPLY, Browser

pytestmark = pytest.mark.django_db(transaction=True)
PHONE = {"viewport": {"width": 390, "height": 844}, "has_touch": True, "is_mobile": True, "device_scale_factor": 3}
# Every control on screen that a finger may tap: what, and its size, for those under 44 px either way.
SMALL_TARGETS = """() => [...document.querySelectorAll('button, a, select, summary, input, textarea')]
  .filter((e) => e.offsetParent !== null && getComputedStyle(e).visibility !== 'hidden')
  .map((e) => [e.id || e.className || e.tagName, e.getBoundingClientRect()])
  .filter(([, box]) => box.width > 0 && box.right > 0 && box.left < innerWidth && Math.min(box.width, box.height) < 44)
  .map(([name, box]) => `${name}: ${Math.round(box.width)}x${Math.round(box.height)}`)"""
SIGN = "() => getComputedStyle(document.querySelector('.settings summary'), '::before').content"


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


def test_every_control_a_finger_taps_is_44_px_each_way_open_settings_steering_and_reply_actions_too(live_service, new_page):
    get_user_model().objects.create_user("reader", password="pw-for-tests-only")
    page = Browser(new_page(**PHONE), live_service.url).page
    assert page.evaluate(SIGN) == '"▸"'  # "Model and parameters" shows that it opens
    page.tap("summary")
    assert page.evaluate(SIGN) == '"▾"' and page.is_visible("#system-prompt")
    assert page.evaluate(SMALL_TARGETS) == []  # the model, numbers, system prompt and tools boxes
    page.select_option("#model", "echo")
    page.tap("summary")
    page.fill("#prompt", "A reply long enough to steer while it streams: " + "word " * 300)
    page.tap("#send")
    page.wait_for_selector("#steer-form:not([hidden])")
    assert page.evaluate(SMALL_TARGETS) == []  # the steering box and its button
    page.wait_for_selector(f"{REPLY}[data-finish-reason]", timeout=60_000)
    page.wait_for_selector(".turn.user .edit")
    assert page.evaluate(SMALL_TARGETS) == []  # Edit, Copy, Regenerate
