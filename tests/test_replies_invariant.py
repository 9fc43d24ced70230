"""A reply at temperature 0, or with a seed, is a function of the request alone.

Through the whole service on its shipped defaults (TOKSTREAM_WEIGHTS=auto, prompt-lookup
drafts on, the prefix cache on): each prompt asked alone, then all of them again at once beside
16 other requests, streamed and not, some twice so that the prefix cache serves them. Every
reply must equal its alone reply token for token. On the old engine (int4 for decoding, float32
for prefill, a fused attention kernel) replies differed from the first token.
"""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.sse import auth, chat_body, content_of, stream_chat

pytestmark = pytest.mark.django_db(transaction=True)

LONG = "Here are my notes from the week, please keep them in mind. " + " ".join(
    f"On day {n} the team met at {8 + n % 5} o'clock, reviewed ticket {1000 + 7 * n}, and agreed that the {['parser', 'cache', 'scheduler', 'page'][n % 4]} needed more tests."
    for n in range(40)
)
PROMPTS = {
    "short": "Name a colour.",
    "long": LONG + " Now summarise the notes in two sentences.",  # over 600 tokens: prefilled in chunks
    "multilingual": "Repeat exactly: Grüße aus Köln! Привет, мир. こんにちは世界 🌍🚀 ¿Qué tal?",
    "translation": "Translate into French: The harbour light turns every nine seconds.",
    "code": "Write a Python function that returns the n-th Fibonacci number.",
    "copying": "Copy this list back to me, one item per line: apples, pears, plums, apples, pears, plums, apples, pears.",
}
OTHERS = [f"Tell me a fact about the number {n}." for n in range(16)]
GREEDY = dict(temperature=0, max_tokens=48)
SEEDED = dict(temperature=0.8, seed=1234, max_tokens=48)


def whole(service, key, prompt, params):
    response = httpx.post(f"{service.url}/v1/chat/completions", json=chat_body(prompt, **params), headers=auth(key), timeout=600)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def streamed(service, key, prompt, params):
    return content_of(data for _, data in stream_chat(service, key, chat_body(prompt, stream=True, **params))[:-1])


def crowd(service, key, params):
    """Every prompt streamed and not, the repeated ones twice each way, beside 16 others."""
    asks = [(name, way) for name in PROMPTS for way in (whole, streamed)]
    asks += [(name, way) for name in ("short", "long", "code") for way in (whole, streamed)]
    others = [(text, streamed) for text in OTHERS]
    with ThreadPoolExecutor(len(asks) + len(others)) as pool:
        futures = [(name, pool.submit(way, service, key, PROMPTS[name], params)) for name, way in asks]
        futures += [(None, pool.submit(way, service, key, text, {**params, "max_tokens": 64})) for text, way in others]
        return [(name, future.result()) for name, future in futures]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_reply_is_the_same_alone_and_beside_others_streamed_or_not_cached_or_not(live_service, api_key, params):
    alone = {name: whole(live_service, api_key, prompt, params) for name, prompt in PROMPTS.items()}
    assert all(alone.values()), alone
    together = crowd(live_service, api_key, params)
    differ = [(name, alone[name], reply) for name, reply in together if name is not None and reply != alone[name]]
    assert not differ, f"{len(differ)} of {len(together) - len(OTHERS)} replies differ from their alone reply: {differ}"
