"""The chat page in a real headless Chromium, against the live service and the real model."""

import shutil

import pytest
from django.db import connections
from playwright.sync_api import sync_playwright

from billing.models import UsageEntry
from tests.service import wait_for_entry

pytestmark = pytest.mark.django_db(transaction=True)
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip

# Records the reply's text length at every animation frame, so the test sees each paint.
WATCH_REPLY = """() => {
  window.__lengths = [];
  const sample = () => {
    const reply = document.querySelector('.turn.assistant .body');
    if (reply) window.__lengths.push(reply.textContent.length);
    requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""


@pytest.fixture
def page(live_service, transactional_db, monkeypatch):
    from django.contrib.auth import get_user_model

    # Playwright's sync API runs an event loop in this thread; the ORM calls of the test are
    # still plain blocking calls, which Django would otherwise refuse.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    get_user_model().objects.create_user("reader", password="pw-for-tests-only")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        page.goto(f"{live_service.url}/")
        page.fill("input[name=username]", "reader")
        page.fill("input[name=password]", "pw-for-tests-only")
        page.click("button[type=submit]")
        page.wait_for_selector("#prompt")
        yield page
        browser.close()
        # Inside Playwright's loop the ORM opened a connection of its own; close it here, or
        # the test database cannot be dropped at the end.
        connections.close_all()


def test_a_reply_grows_in_steps_and_ends_with_its_usage(page):
    page.evaluate(WATCH_REPLY)
    page.fill("#prompt", "Write two sentences about the sea.")
    page.keyboard.press("Enter")
    page.wait_for_selector(".turn.assistant .meta", timeout=60_000)
    lengths = page.evaluate("window.__lengths")
    final = lengths[-1]
    steps = sorted({n for n in lengths if 0 < n < final})
    assert final > 0
    assert len(steps) >= 2, f"the reply appeared in {len(steps) + 1} paint(s): {lengths}"
    usage_text = page.text_content("#usage")
    entry = UsageEntry.objects.get()
    assert usage_text == (
        f"{entry.prompt_tokens} prompt + {entry.completion_tokens} completion = {entry.total_tokens} tokens"
    )
    assert page.text_content("#status") == "done"
    assert "ms" in page.text_content("#ttft")


def test_stop_cancels_the_reply_on_the_server(page):
    page.fill("#prompt", "Write a very long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function("document.querySelector('.turn.assistant .body').textContent.length > 20", timeout=60_000)
    page.click("#stop")
    page.wait_for_selector(".turn.assistant .meta", timeout=30_000)
    entry = UsageEntry.objects.get()
    assert entry.status == "cancelled"
    assert page.text_content("#status") == "stopped"
    assert page.text_content(".turn.assistant .body").strip()  # the partial reply stays


def test_leaving_the_page_cancels_the_reply(page, live_service):
    page.fill("#prompt", "Write a very long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function("document.querySelector('.turn.assistant .body').textContent.length > 20", timeout=60_000)
    page.goto(f"{live_service.url}/accounts/login/")  # another page: the reply's page is gone
    entry = wait_for_entry(seconds=15)
    assert entry.status == "cancelled"
    assert entry.completion_tokens < 512

