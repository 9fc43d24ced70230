"""A prompt that takes longer to prefill than the keep-alive interval: the client hears from
the server all along, and gets its reply."""

import pytest
from django.conf import settings

from tests.faults.conftest import rows_for
from tests.faults.streams import body, record_many

pytestmark = pytest.mark.django_db(transaction=True)


def long_prompt(tokenizer, words, tokens):
    """A user message whose chat prompt is about `tokens` long."""
    text = words * (2 * tokens // len(tokenizer.encode(words)))
    while len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)) > tokens:
        text = text[: int(len(text) * 0.98)]
    return text + "\nIn one word, what colour were they?"


def test_keepalives_flow_while_long_prompts_are_prefilled(live_service, api_key, tokenizer):
    # Two at once: the second waits for both prefills (about 10,000 tokens; 48 s on these
    # machines), past the keep-alive interval on machines three times faster too.
    texts = ["The tea plantations were green and wet in the morning. ", "A red kite circled over the old mill. "]
    payloads = [body(long_prompt(tokenizer, text, 5000), max_tokens=8) for text in texts]
    streams = record_many(live_service.url, api_key, payloads)
    waits = [stream.first_text_at - stream.opened_at for stream in streams if stream.first_text_at]
    assert max(waits) > settings.TOKSTREAM_KEEPALIVE_SECONDS + 1, f"prefills took {waits} s: the test needs longer prompts here"
    for stream in streams:
        assert stream.done and stream.error is None, stream.failure
        waited = stream.first_text_at - stream.opened_at
        assert stream.keepalives_before_text >= int(waited // settings.TOKSTREAM_KEEPALIVE_SECONDS) - 1
        [row] = rows_for([stream.request_id], seconds=30)[stream.request_id]
        assert row.prompt_tokens == stream.usage["prompt_tokens"] > 4500 and row.completion_tokens == stream.usage["completion_tokens"]
