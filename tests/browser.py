"""Headless Chromium for the tests that drive a page: Debian's chromium, launched once a session
by Playwright's own browser server; each page a test opens comes in a browser context (cookies,
storage) of its own."""

import json
import shutil
import subprocess

import pytest
from django.db import connections
from playwright._impl._driver import compute_driver_executable
from playwright.sync_api import sync_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture(scope="session")
def chromium(tmp_path_factory):
    """The browser server's endpoint. Playwright's sync API marks an asyncio loop as running in
    this thread for as long as it is started, which would make every later test's async_to_sync
    and ORM calls refuse to run; so the browser lives in a server of its own (launched with
    Playwright's switches, as `launch` would), and each test connects to it for its own length."""
    config = tmp_path_factory.mktemp("chromium") / "launch.json"
    config.write_text(json.dumps({"executablePath": CHROMIUM, "args": FLAGS, "headless": True}))
    node, cli = compute_driver_executable()  # the driver the Python package ships and runs
    server = subprocess.Popen([node, cli, "launch-server", "--browser", "chromium", "--config", str(config)], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = server.stdout.readline().strip()
        assert endpoint.startswith("ws://"), f"the browser server did not start: {endpoint!r}"
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=15)


@pytest.fixture
def new_page(chromium, monkeypatch):
    """Opens a page in a fresh browser context; the test's contexts are closed after it."""
    # The ORM calls of the test are plain blocking calls, which Django refuses while
    # Playwright's loop is marked running in this thread.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as pw:
        browser = pw.chromium.connect(chromium)
        contexts = []

        def open_page(**context_options):  # a phone's viewport and touch, say
            contexts.append(browser.new_context(**context_options))
            return contexts[-1].new_page()

        yield open_page
        # While Playwright runs, the test's ORM calls get connections of their own (Django's
        # are per async context); closed from here, or the test database cannot be dropped.
        connections.close_all()
        for context in contexts:
            context.close()
        browser.close()
    connections.close_all()
