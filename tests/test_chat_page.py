"""The chat page in a real headless Chromium, against the live service: the real model, and
the echo model (tests/settings.py) where a test needs to script exactly what streams."""

from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils import timezone
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from billing.models import PriceSheet, UsageEntry
from inference.models import Chat, Turn
from tests.proxy import CuttableProxy
from tests.service import wait_for_entry
from tests.sse import MODEL
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
REPLY = ".turn.assistant:last-of-type"
LONG_STORY = "Write a very long story about a lighthouse keeper."
LONG = " ".join(f"word{n}" for n in range(1000))  # 3,891 tokens: with max_tokens 4000, about a minute of the echo model

# Every animation frame: the reply's visible text; the first frozen block once it exists, and
# whether it or its content was ever made anew while the reply streamed.
WATCH_REPLY = """() => {
  window.__frames = [];
  window.__args = [];
  const sample = () => {
    const reply = document.querySelector('.turn.assistant:last-of-type .body');
    if (reply) window.__frames.push(reply.textContent);
    const block = document.querySelector(".turn.assistant:last-of-type .md-block");
    if (block && !window.__firstBlock) [window.__firstBlock, window.__firstContent] = [block, block.firstElementChild];
    if (block && (block !== window.__firstBlock || block.firstElementChild !== window.__firstContent)) window.__redone = true;
    const args = document.querySelector('.tool-args');
    if (args) window.__args.push(args.textContent);
    requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""


# Every animation frame while a tool call's arguments stream: the completion count shown.
WATCH_COMPLETION_WHILE_CALLING = """() => {
  window.__counted = [];
  const sample = () => {
    if (document.querySelector('.turn.assistant:last-of-type .tool-args')) window.__counted.push(document.querySelector('#completion').textContent);
    requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""


class Browser:
    """One signed-in page, with what it printed to its console."""

    def __init__(self, page, base_url):
        self.page = page
        self.errors = []
        self.requests = []
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.goto(f"{base_url}/")
        self.page.fill("input[name=username]", "reader")
        self.page.fill("input[name=password]", "pw-for-tests-only")
        self.page.click("button[type=submit]")
        self.page.wait_for_selector("#prompt")

    def send(self, text, model=MODEL, **fields):
        page = self.page
        page.click("summary")  # the parameters
        page.select_option("#model", model)
        for field, value in fields.items():
            page.fill(f"#{field.replace('_', '-')}", str(value))
        page.click("summary")
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")

    def wait_until_done(self, seconds=90):
        try:
            self.page.wait_for_selector(f"{REPLY}[data-finish-reason]", timeout=seconds * 1000)
        except PlaywrightTimeout:
            status = self.page.text_content("#status")
            raise AssertionError(f"the reply did not end: status {status!r}, page errors {self.errors}") from None

    def reply_text(self):
        return self.page.text_content(f"{REPLY} .body")


def wait_for_text(page, characters, seconds=30):
    """Until the reply being written shows more than `characters` characters."""
    # A function, not an expression: the page's CSP forbids the eval an expression needs.
    script = f"() => (document.querySelector('{REPLY} .body')?.textContent || '').length > {characters}"
    page.wait_for_function(script, timeout=seconds * 1000)


@pytest.fixture
def browser(live_service, transactional_db, new_page):
    return chat_page(new_page, live_service.url)


def chat_page(new_page, base_url):
    """The chat page at `base_url`, signed in as a user of its own."""
    get_user_model().objects.create_user("reader", password="pw-for-tests-only")
    return Browser(new_page(), base_url)


def price(model):
    return PriceSheet.objects.create(
        model=model,
        input_per_million=Decimal("0.15"),
        cached_input_per_million=Decimal("0.075"),
        output_per_million=Decimal("0.60"),
        effective_from=timezone.now() - timedelta(days=1),
    )


def test_a_real_reply_grows_in_steps_and_ends_with_the_usage_and_cost_of_its_ledger_entry(browser):
    price(MODEL)
    page = browser.page
    page.evaluate(WATCH_REPLY)
    browser.send("Write two sentences about the sea.", max_tokens=60)
    browser.wait_until_done()
    page.wait_for_selector(f"{REPLY} .meta .usage")
    frames = page.evaluate("window.__frames")
    lengths = sorted({len(text) for text in frames if text})
    assert len(lengths) >= 3, f"the reply appeared in {len(lengths)} paint(s)"
    entry = UsageEntry.objects.get()
    assert entry.total_cost > 0
    expected = usage_line(entry)
    assert page.text_content(f"{REPLY} .meta .usage") == expected
    assert page.text_content("#usage") == expected
    assert page.text_content("#status") == "done"
    # One time to first token and one rate on the page: the ledger's, in the bar as under the reply.
    ttft, rate = round(entry.time_to_first_token * 1000), round(entry.tokens_per_second, 1)
    assert page.text_content("#ttft") == f"{ttft} ms" and float(page.text_content("#rate")) == rate
    assert page.text_content(f"{REPLY} .meta .timing") == f"{ttft} ms to first token · {rate:g} tokens/s"
    assert page.text_content("#stats-of") == "Last reply:"
    page.reload()  # the bar keeps the reply's numbers, never "–" beside a reply that has them
    page.wait_for_selector(f"{REPLY} .meta .usage")
    bar = [page.text_content(f"#{name}") for name in ("stats-of", "ttft", "rate", "usage")]
    assert bar == ["Last reply:", f"{ttft} ms", f"{rate:g}", expected]
    assert browser.errors == []


def usage_line(entry):
    """What the page says of an entry's usage: its cost with the parts it is made of."""

    def text(value):
        return format(value.normalize(), "f")

    cached = f" ({entry.cached_prompt_tokens} cached)" if entry.cached_prompt_tokens else ""
    parts = f"input {text(entry.input_cost)} + cached input {text(entry.cached_input_cost)} + output {text(entry.output_cost)}"
    return f"{entry.prompt_tokens} prompt{cached} + {entry.completion_tokens} completion = {entry.total_tokens} tokens · {text(entry.total_cost)} USD ({parts})"


def test_the_history_is_kept_on_the_server_and_a_reload_shows_it_with_its_numbers(browser, live_service):
    page = browser.page
    browser.send("First message", model="echo")
    browser.wait_until_done()
    page.wait_for_selector(f"{REPLY} .meta .usage")
    browser.send("Second message", model="echo")
    page.wait_for_function("() => document.querySelectorAll('.turn.assistant[data-finish-reason] .meta .usage').length == 2")
    chat = Chat.objects.get()
    assert page.url.endswith(f"/c/{chat.pk}")
    assert [(t.role, t.content) for t in chat.turns.all()] == [
        ("user", "First message"), ("assistant", "First message"), ("user", "Second message"), ("assistant", "Second message"),
    ]  # fmt: skip
    numbers = page.text_content(f"{REPLY} .meta")
    page.reload()
    page.wait_for_selector(f"{REPLY} .meta .usage")
    assert page.locator(".turn").all_text_contents()[0] == "First message"
    assert page.text_content(f"{REPLY} .meta") == numbers
    assert page.text_content(".chat-link.current") == "First message"
    assert page.locator(".regenerate").count() == 1
    page.click(".regenerate")
    page.wait_for_selector(".regenerate")  # back once the new reply has its numbers
    assert [t.content for t in chat.turns.all()] == ["First message", "First message", "Second message", "Second message"]
    assert Turn.objects.filter(role="assistant").count() == 2


def test_streamed_markdown_never_shows_raw_markers_and_finished_blocks_are_left_alone(browser):
    page = browser.page
    page.evaluate(WATCH_REPLY)
    message = (
        "An opening line with **bold words inside** it.\n\n"
        "```python\ndef double(x):\n    return x * 2\n```\n\n"
        "And a closing paragraph that goes on for a while, so that deltas keep arriving "
        "long after the first blocks are complete and frozen in place."
    )
    browser.send(message, model="echo")
    browser.wait_until_done()
    frames = [text for text in page.evaluate("window.__frames") if text]
    assert len(set(frames)) > 20, "the reply should have been painted in many steps"
    shown_raw = [text for text in frames if "**" in text or "```" in text or "``" in text]
    assert shown_raw == []
    assert page.text_content(f"{REPLY} strong") == "bold words inside"
    assert page.text_content(f"{REPLY} pre code") == "def double(x):\n    return x * 2\n"
    # The first paragraph, frozen at its blank line, was never rendered again while the reply
    # streamed; once it ended the reply was rendered whole, as a reload renders it.
    assert page.evaluate("window.__firstBlock.textContent") == "An opening line with bold words inside it.\n"
    assert page.evaluate("window.__redone") is None
    assert page.locator(f"{REPLY} .md-block, {REPLY} .md-tail").count() == 0
    assert browser.errors == []


def test_model_output_cannot_run_script_and_is_shown_as_text(browser):
    page = browser.page
    csp = page.reload().headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    payload = (
        '<img src=x onerror="window.__pwned=1">\n\n'
        "<script>window.__pwned=2</script>\n\n"
        "[click me](javascript:window.__pwned=3)\n\n"
        "![a remote picture](http://127.0.0.1:9/remote.png)"
    )
    browser.send(payload, model="echo")
    browser.wait_until_done()
    reply = page.locator(REPLY)
    reply.locator("a", has_text="click me").click()
    page.wait_for_timeout(300)
    assert page.evaluate("window.__pwned") is None
    text = page.text_content(f"{REPLY} .body")
    assert '<img src=x onerror="window.__pwned=1">' in text and "<script>window.__pwned=2</script>" in text
    assert reply.locator("script, img, iframe, [onerror]").count() == 0
    assert reply.locator("a", has_text="click me").get_attribute("href") is None
    assert reply.locator(".image-link").get_attribute("href") == "http://127.0.0.1:9/remote.png"
    assert not [url for url in browser.requests if "remote.png" in url], "a remote image was loaded"


def test_stop_cancels_on_the_server_and_keeps_the_partial_reply(browser):
    page = browser.page
    browser.send(LONG_STORY, max_tokens=400)
    wait_for_text(page, 20, seconds=60)
    page.keyboard.press("Escape")
    browser.wait_until_done(30)
    entry = wait_for_entry(seconds=15)
    assert entry.status == "cancelled" and entry.completion_tokens < 400
    shown = browser.reply_text()
    page.wait_for_timeout(1000)
    assert browser.reply_text() == shown and shown.strip()  # nothing more arrives
    assert UsageEntry.objects.get().completion_tokens == entry.completion_tokens
    assert page.text_content("#status") == "stopped"
    page.wait_for_selector(f"{REPLY} .meta .usage")
    assert f"+ {entry.completion_tokens} completion" in page.text_content(f"{REPLY} .meta .usage")
    assert Turn.objects.get(role="assistant").finish_reason == "cancelled"


def test_steering_marks_where_the_instruction_took_effect(browser):
    page = browser.page
    browser.send(LONG_STORY, max_tokens=120)
    wait_for_text(page, 20, seconds=60)
    page.fill("#steer", " Then a storm came.")
    page.press("#steer", "Enter")
    page.wait_for_selector(f"{REPLY} .steer-mark", timeout=30_000)
    browser.wait_until_done()
    assert page.text_content(f"{REPLY} .steer-mark") == "↳ Then a storm came."
    entry = wait_for_entry(seconds=15)
    assert entry.steering_tokens > 0
    # The turn is settled, its steering with it, on request_finished: after the ledger entry.
    turn = eventually(lambda: Turn.objects.exclude(finish_reason="").filter(role="assistant").first(), 15, message="the reply's turn was not settled")
    # The page samples (temperature 0.3, no seed) and the steering lands where the stream is: the
    # reply may end right after it (seen once in CI: "The lighthouse keeper's" + mark, then EOS).
    assert turn.steering[0]["text"] == " Then a storm came." and 0 < turn.steering[0]["at"] <= len(turn.content)


def test_a_cut_connection_resumes_the_same_reply_without_a_gap_or_a_repeat(live_service, transactional_db, new_page, api_key):
    proxy = CuttableProxy(live_service.port)
    try:
        browser = chat_page(new_page, proxy.url)
        page = browser.page
        browser.send("Tell me about the moon.", temperature=0.8, seed=7, max_tokens=80)
        wait_for_text(page, 10, seconds=60)
        assert proxy.cut() >= 1
        page.wait_for_function("() => document.querySelector('#status').textContent === 'reconnecting…'", timeout=10_000)
        browser.wait_until_done()
        shown = page.get_attribute(REPLY, "data-text")
    finally:
        proxy.close()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the moon."}], "temperature": 0.8, "seed": 7, "max_tokens": 80}
    uncut = httpx.post(f"{live_service.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=120)
    assert shown == uncut.json()["choices"][0]["message"]["content"]


def test_a_reload_in_the_middle_of_a_reply_shows_the_whole_reply(browser):
    page = browser.page
    message = " ".join(f"word{n}" for n in range(120))
    browser.send(message, model="echo")
    wait_for_text(page, 30)
    page.reload()
    browser.wait_until_done()
    assert page.get_attribute(REPLY, "data-text") == message
    assert browser.reply_text().strip() == message
    entry = wait_for_entry(seconds=10, model="echo")  # the rate is the generation's, never the replay burst's
    page.wait_for_function(f"() => document.querySelector('#rate').textContent === '{round(entry.tokens_per_second, 1):g}'")


def test_a_streamed_tool_call_grows_as_text_and_shows_its_parsed_arguments_at_the_end(browser):
    page = browser.page
    page.evaluate(WATCH_REPLY)
    tools = '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]'
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": [1, 2, 3]}}\n</tool_call>'
    page.evaluate(WATCH_COMPLETION_WHILE_CALLING)
    browser.send(f"Let me check.{call}", model="echo", tools=tools)
    browser.wait_until_done()
    counted = [int(n) for n in page.evaluate("window.__counted") if n.isdigit()]
    assert len(set(counted)) > 3, f"the completion count should grow while the call streams: {counted}"
    grown = sorted({len(text) for text in page.evaluate("window.__args")})
    assert len(grown) > 3, "the arguments should have grown in several steps"
    assert page.get_attribute(REPLY, "data-finish-reason") == "tool_calls"
    assert page.text_content(f"{REPLY} .tool-name") == "get_weather()"
    parsed = page.text_content(f"{REPLY} .tool-call.complete .tool-parsed")
    assert '"city": "Paris"' in parsed and '"days": [\n    1,' in parsed
    assert "tool_call" not in browser.reply_text()
    assert browser.errors == []


def test_the_status_region_announces_the_reply_not_each_token(browser):
    page = browser.page
    page.evaluate("""() => {
      window.__statuses = [];
      new MutationObserver(() => window.__statuses.push(document.querySelector('#status').textContent))
        .observe(document.querySelector('#status'), {childList: true, characterData: true, subtree: true});
    }""")
    page.fill("#prompt", "A first line")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "a second line")
    assert page.input_value("#prompt") == "A first line\na second line"
    page.click("summary")
    page.select_option("#model", "echo")
    page.press("#prompt", "Enter")
    browser.wait_until_done()
    assert page.evaluate("window.__statuses") == ["sending", "generating", "done"]
    assert page.get_attribute("#log", "role") == "log"
    assert page.get_attribute("#status", "aria-live") == "polite"


def test_leaving_the_page_cancels_the_reply(browser, live_service):
    """The reply must outlast the abandon grace (10 s, as shipped) whatever the machine: the
    echo model's minute-long one, not a story the real model may end within the grace."""
    page = browser.page
    browser.send(LONG, model="echo", max_tokens=4000)
    wait_for_text(page, 20, seconds=60)
    page.goto(f"{live_service.url}/accounts/login/")  # another page: the reply's page is gone
    entry = wait_for_entry(seconds=settings.TOKSTREAM_ABANDON_SECONDS + 10)
    assert entry.status == "cancelled"
    assert entry.completion_tokens < 4000
    # The chat page settles its turn after the ledger entry is written, on request_finished.
    eventually(lambda: Turn.objects.get(role="assistant").finish_reason == "cancelled", 5, message="the turn was not marked cancelled")


def below_view(page):
    """How far the conversation goes on below what the reader sees, in pixels."""
    return page.evaluate("() => { const log = document.querySelector('#log'); return log.scrollHeight - log.scrollTop - log.clientHeight; }")


def test_the_view_follows_new_text_only_while_the_reader_is_at_the_bottom(browser):
    page = browser.page
    paragraphs = "\n\n".join(f"Paragraph {n} of a reply long enough to scroll the view." for n in range(60))
    browser.send(paragraphs, model="echo")
    for characters in (200, 400, 600, 800):
        wait_for_text(page, characters)
        assert below_view(page) < 24
    page.evaluate("() => { document.querySelector('#log').scrollTop = 0; }")  # the reader scrolls up
    grown = page.evaluate("() => document.querySelector('#log').scrollHeight")
    page.wait_for_function(f"() => document.querySelector('#log').scrollHeight > {grown} + 100")
    assert page.evaluate("() => document.querySelector('#log').scrollTop") == 0
    assert page.is_visible("#jump")
    page.click("#jump")
    wait_for_text(page, 1400)
    assert below_view(page) < 24
    browser.wait_until_done()
    assert below_view(page) < 24
    assert not page.is_visible("#jump")


def test_the_composer_shows_the_prompt_s_tokens_and_cost_as_it_is_typed(browser):
    price("echo")
    page = browser.page
    page.click("summary")
    page.select_option("#model", "echo")
    page.click("summary")
    page.type("#prompt", "How many tokens is this?")
    page.wait_for_function("() => document.querySelector('#prompt-count').textContent.includes('prompt tokens')")
    shown = page.text_content("#prompt-count")
    page.press("#prompt", "Enter")
    browser.wait_until_done()
    entry = wait_for_entry(seconds=15)
    cost = format((Decimal(entry.prompt_tokens) * Decimal("0.15") / 1_000_000).normalize(), "f")
    assert shown == f"{entry.prompt_tokens} prompt tokens · {cost} USD"
    assert page.text_content("#prompt-count") == ""
