"""The echo model: the engine streams back the last user message, token for token."""

from inference.worker.engine import Engine, Request, SamplingParams
from inference.worker.engine.echo import EchoModel, EchoRunner

MARKDOWN = "Some **bold** text.\n\n```python\nprint('<b>hi</b>')\n```\n\nDone: é, 漢字, 🎉."


def echo_engine(tokenizer, cache_tokens=2048):
    runner = EchoRunner(EchoModel.for_tokenizer(tokenizer), cache_tokens, 16)
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return Engine(runner, tokenizer, stop_ids=stop, context_length=8192)


def prompt(tokenizer, *user_messages):
    turns = [{"role": "system", "content": "You are terse."}]
    for text in user_messages:
        turns += [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    return list(tokenizer.apply_chat_template(turns[:-1], add_generation_prompt=True, tokenize=True))


def reply(engine, request_id, prompt_ids, **params):
    engine.add(Request(request_id, prompt_ids, SamplingParams(**{"max_tokens": 500, **params})))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return "".join(o.text for o in outputs if o.request_id == request_id), outputs[-1]


def test_it_replies_with_the_last_user_message(tokenizer):
    text, last = reply(echo_engine(tokenizer), "a", prompt(tokenizer, "first", MARKDOWN), temperature=1.0)
    assert text == MARKDOWN
    assert last.finish_reason == "stop"


def test_it_sees_the_whole_prompt_when_the_prefix_cache_served_part_of_it(tokenizer):
    engine = echo_engine(tokenizer)
    long_history = ["word " * 40, "more " * 40]
    reply(engine, "a", prompt(tokenizer, *long_history, "one"))
    text, _ = reply(engine, "b", prompt(tokenizer, *long_history, "two"))
    assert engine.stats["cached_prompt_tokens"] > 0
    assert text == "two"


def test_max_tokens_cuts_the_echo(tokenizer):
    text, last = reply(echo_engine(tokenizer), "a", prompt(tokenizer, "one two three four five six"), max_tokens=3)
    assert last.finish_reason == "length" and last.completion_tokens == 3
    assert text == "one two three"
