"""Chats as the page keeps them, in headless Chromium against the live service: each chat's
model and parameters come back with it, each reply names its model, a chat can be renamed and
deleted (its usage stays in the ledger), and the page is dark when the system is."""

import json

import pytest

from billing.models import UsageEntry
from inference.models import Chat
from tests.sse import MODEL
from tests.test_chat_page import REPLY, chat_page

pytestmark = pytest.mark.django_db(transaction=True)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_a_chat_keeps_its_model_and_parameters_and_each_reply_names_its_model(live_service, new_page):
    browser = chat_page(new_page, live_service.url)
    browser.send("Hello there.", model=MODEL, temperature="0.7", max_tokens="6", seed="5", tools=json.dumps(TOOLS))
    browser.wait_until_done()
    page = browser.page
    page.wait_for_selector(f"{REPLY} .meta .model")
    assert page.text_content(f"{REPLY} .meta .model") == MODEL
    page.goto(f"{live_service.url}/")  # a new chat has the page's defaults
    assert page.input_value("#model") == "echo" and page.input_value("#temperature") == "0.3" and page.input_value("#tools") == ""
    page.goto(f"{live_service.url}/c/{Chat.objects.get().pk}")
    page.wait_for_selector(f"{REPLY} .meta .model")
    fields = {name: page.input_value(f"#{name}") for name in ("model", "temperature", "max-tokens", "seed")}
    assert fields == {"model": MODEL, "temperature": "0.7", "max-tokens": "6", "seed": "5"}
    assert json.loads(page.input_value("#tools")) == TOOLS
    assert page.text_content(f"{REPLY} .meta .model") == MODEL


def test_a_chat_is_renamed_and_deleted_and_its_usage_stays_in_the_ledger(live_service, new_page):
    browser = chat_page(new_page, live_service.url)
    browser.send("Hello there.", model="echo")
    browser.wait_until_done()
    page = browser.page
    page.once("dialog", lambda dialog: dialog.accept("Greetings, renamed"))
    page.click("#rename")
    page.wait_for_selector(".chat-link.current >> text=Greetings, renamed")
    page.reload()
    assert page.text_content(".chat-link.current") == "Greetings, renamed" and Chat.objects.get().title == "Greetings, renamed"
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete")
    page.wait_for_url(f"{live_service.url}/")
    assert not Chat.objects.exists() and UsageEntry.objects.filter(model="echo").count() == 1
    assert page.locator(".chat-link").count() == 0


def test_the_page_is_dark_when_the_system_is(live_service, new_page):
    page = chat_page(new_page, live_service.url).page
    light = page.evaluate("() => getComputedStyle(document.documentElement).backgroundColor")
    page.emulate_media(color_scheme="dark")
    dark = page.evaluate("() => getComputedStyle(document.documentElement).backgroundColor")
    assert light == "rgb(246, 246, 248)" and dark == "rgb(22, 22, 26)"
