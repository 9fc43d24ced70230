"""A reply's markdown in headless Chromium against the live service, streamed by the echo model
(which replies with the message sent, one token per step): what streamed ends as the same DOM a
reload shows, no frame shows a table's pipes or a reference link raw (its text shows until its
definition comes), streamed blocks are spaced as reloaded ones, code is highlighted once its
block is complete, and a reply cut right after an opening fence shows no empty code box."""

import re

import pytest

from tests.test_chat_page import REPLY, chat_page

pytestmark = pytest.mark.django_db(transaction=True)
FENCE = "```"
CORPUS = f"""# A heading

An opening paragraph with **bold** and *emphasis*, long enough to take a while to stream.

A second paragraph, so that the space between two streamed paragraphs can be measured.

## Lists

- first bullet
- second bullet with `code`

1. first step
2. second step

| Name | Value |
| --- | --- |
| alpha | 1 |
| beta | 2 |

Read [the docs][docs] before you start.

{FENCE}python
def double(x):
    return x * 2
{FENCE}

[docs]: https://example.com/docs

After the definition, a closing paragraph."""

# Every animation frame: what shows raw (pipes outside code, the reference link once its
# definition and the text after it arrived), and, once the table is frozen, the vertical
# layout of the frozen blocks' elements.
WATCH_MARKDOWN = """() => {
  window.__raw = [];
  window.__layout = null;
  const outsideCode = (body) => {
    const walker = document.createTreeWalker(body, NodeFilter.SHOW_TEXT);
    const texts = [];
    while (walker.nextNode()) if (!walker.currentNode.parentElement.closest('pre, code')) texts.push(walker.currentNode.data);
    return texts.join('');
  };
  const sample = () => {
    const body = document.querySelector('.turn.assistant:last-of-type .body');
    if (body) {
      const text = outsideCode(body);
      const pipeParagraph = [...body.querySelectorAll('p')].some((p) => p.textContent.trimStart().startsWith('|'));
      if (text.includes('|') || pipeParagraph) window.__raw.push(['pipes', text]);
      if (text.includes('[docs]:')) window.__raw.push(['definition', text]);
      if (text.includes('][docs]') || text.includes('[the docs]')) window.__raw.push(['reference', text]);
      if (text.includes('Read the docs before') && !body.querySelector('a[href="https://example.com/docs"]')) window.__unlinked = true;
      if (!window.__layout && body.querySelector('.md-block table')) window.__layout = layout([...body.querySelectorAll('.md-block > *')]);
    }
    requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""

# Each element's tag, margins and the space above it (from the element before it).
LAYOUT = """window.layout = (elements) => elements.map((e, i) => {
  const style = getComputedStyle(e);
  const above = i ? e.getBoundingClientRect().top - elements[i - 1].getBoundingClientRect().bottom : null;
  return [e.tagName, style.marginTop, style.marginBottom, above];
})"""

BODY_HTML = f"() => document.querySelector('{REPLY} .body').innerHTML"


def normalised(html):
    return re.sub(r">\s+<", "><", html).strip()


def reloaded(page):
    page.reload()
    page.wait_for_selector(f"{REPLY}[data-finish-reason]")
    return page


def test_a_streamed_reply_ends_as_the_dom_a_reload_shows_and_no_frame_shows_markdown_raw(live_service, new_page):
    browser = chat_page(new_page, live_service.url)
    page = browser.page
    page.evaluate(f"() => {{ {LAYOUT}; }}")
    page.evaluate(WATCH_MARKDOWN)
    browser.send(CORPUS, model="echo")
    browser.wait_until_done()
    live = normalised(page.evaluate(BODY_HTML))
    raw, streamed = page.evaluate("window.__raw"), page.evaluate("window.__layout")
    assert raw == [] and page.evaluate("window.__unlinked")  # the link's text showed before its definition came
    assert page.get_attribute(f"{REPLY} a", "href") == "https://example.com/docs"
    assert page.locator(f"{REPLY} table td").all_text_contents() == ["alpha", "1", "beta", "2"]
    reloaded(page)
    assert normalised(page.evaluate(BODY_HTML)) == live
    page.evaluate(f"() => {{ {LAYOUT}; }}")
    whole = page.evaluate(f"() => layout([...document.querySelectorAll('{REPLY} .md > *')])")
    # The frozen blocks (heading, paragraphs, lists, the table) were spaced as the whole reply is.
    assert [tag for tag, *_ in streamed] == ["H1", "P", "P", "H2", "UL", "OL", "TABLE"]
    assert streamed == whole[: len(streamed)]
    assert browser.errors == []


# Every animation frame while the reply streams: the number of highlighted tokens in it, how much
# code it shows, and whether the text after the code block has come.
WATCH_HIGHLIGHT = """() => {
  window.__highlighted = [];
  const sample = () => {
    const body = document.querySelector('.turn.assistant:last-of-type .body');
    const done = document.querySelector('.turn.assistant:last-of-type[data-finish-reason]');
    const code = body?.querySelector('pre code');
    if (code && !done) window.__highlighted.push([code.querySelectorAll('[class^=hljs-]').length, code.textContent.length, body.textContent.includes('Closing words')]);
    requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""


def test_a_python_block_is_highlighted_once_complete_while_streaming_and_after_a_reload(live_service, new_page):
    browser = chat_page(new_page, live_service.url)
    page = browser.page
    page.evaluate(WATCH_HIGHLIGHT)
    code = "import math\n\n\ndef area(radius):\n    return math.pi * radius ** 2\n"
    browser.send(f"Some code:\n\n{FENCE}python\n{code}{FENCE}\n\nClosing words of the reply, long enough to stream for a few frames.", model="echo")
    browser.wait_until_done()
    frames = page.evaluate("window.__highlighted")
    open_block = [count for count, shown, _ in frames if shown < len(code) - 1]
    complete = [count for count, _, after in frames if after]
    assert len(open_block) > 5 and set(open_block) == {0}, "a block still arriving is the tail's: never highlighted"
    assert complete and min(complete) > 0, "the complete block is highlighted while the reply still streams"
    keyword = f"{REPLY} pre code .hljs-keyword"
    assert page.locator(keyword).all_text_contents()[:3] == ["import", "def", "return"]
    assert page.text_content(f"{REPLY} pre code") == code
    live = normalised(page.evaluate(BODY_HTML))
    reloaded(page)
    assert page.locator(keyword).all_text_contents()[:3] == ["import", "def", "return"]
    assert normalised(page.evaluate(BODY_HTML)) == live


def test_a_reply_cut_by_the_token_limit_right_after_an_opening_fence_shows_no_empty_code_box(live_service, new_page):
    from inference import registry
    from inference.model_files import load_tokenizer

    message = f"Here is the code:\n\n{FENCE}python\nprint('hello')\n{FENCE}\n"
    tokenizer = load_tokenizer(registry.folder("smollm2-135m-instruct"))
    ids = tokenizer.encode(message, add_special_tokens=False)
    cut = next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]).endswith(f"{FENCE}python\n"))
    browser = chat_page(new_page, live_service.url)
    page = browser.page
    browser.send(message, model="echo", max_tokens=cut)
    browser.wait_until_done()
    assert page.get_attribute(REPLY, "data-finish-reason") == "length"
    assert browser.reply_text().strip() == "Here is the code:"
    assert page.locator(f"{REPLY} pre, {REPLY} .copy-code").count() == 0
    reloaded(page)
    assert page.locator(f"{REPLY} pre, {REPLY} .copy-code").count() == 0 and browser.reply_text().strip() == "Here is the code:"
    assert browser.errors == []
