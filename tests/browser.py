"""Headless Chromium for the tests that drive a page: Debian's chromium, started once a session;
each page a test opens comes in a browser context (cookies, storage) of its own."""

import shutil
import subprocess

import httpx
import pytest
from django.db import connections
from playwright.sync_api import sync_playwright

from tests.settings import free_port
from tests.waiting import eventually

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars", "--mute-audio",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
    # As Playwright launches it: a page nobody looks at still paints every frame and runs its timers.
    "--disable-background-timer-throttling", "--disable-backgrounding-occluded-windows", "--disable-renderer-backgrounding",
]  # fmt: skip


def devtools_answers(endpoint):
    try:
        return httpx.get(f"{endpoint}/json/version", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def chromium(tmp_path_factory):
    """The browser process's DevTools endpoint. Playwright's sync API marks an asyncio loop as
    running in this thread for as long as it is started, which would make every later test's
    async_to_sync and ORM calls refuse to run; so the browser outlives Playwright, and each test
    connects to it for its own length."""
    port = free_port()
    profile = tmp_path_factory.mktemp("chromium")
    command = [CHROMIUM, *FLAGS, f"--remote-debugging-port={port}", f"--user-data-dir={profile}", "about:blank"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: devtools_answers(endpoint), 30, message=f"{CHROMIUM} did not open its DevTools port")
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def new_page(chromium, monkeypatch):
    """Opens a page in a fresh browser context; the test's contexts are closed after it."""
    # The ORM calls of the test are plain blocking calls, which Django refuses while
    # Playwright's loop is marked running in this thread.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as pw:
        browser = pw.chromium.connect_over_cdp(chromium)
        contexts = []

        def open_page():
            contexts.append(browser.new_context())
            return contexts[-1].new_page()

        yield open_page
        for context in contexts:
            context.close()
        browser.close()
    # Inside Playwright's loop the ORM opened a connection of its own; close it here, or the
    # test database cannot be dropped at the end.
    connections.close_all()
