"""Hermes-style tool calls: the prompt that lists the tools, and the streaming parser."""

import json

from inference.protocol import tools
from inference.protocol.tools import ToolCallParser


def parse(text, step=1):
    parser = ToolCallParser()
    events = [e for i in range(0, len(text), step) for e in parser.feed(text[i : i + step])]
    return events + parser.finish()


def summary(events):
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = {}
    for event in events:
        if event[0] == "call":
            calls[event[1]] = {"name": event[3], "arguments": ""}
        elif event[0] == "arguments":
            calls[event[1]]["arguments"] += event[2]
    return content, [calls[i] for i in sorted(calls)]


def test_a_call_streams_its_name_first_then_its_arguments_in_pieces():
    reply = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    events = parse(reply)
    content, calls = summary(events)
    assert content == "Let me check.\n"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}]
    kinds = [e[0] for e in events if e[0] != "content"]
    assert kinds[0] == "call" and kinds.count("arguments") > 5  # it streamed, not all at the close
    assert all(e[2].startswith("call_") for e in events if e[0] == "call")


def test_every_split_of_the_reply_gives_the_same_calls():
    reply = 'A<tool_call>{"name": "f", "arguments": {"s": "a}b", "n": {"k": [1, 2]}}}</tool_call>B<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    expected = ("AB", [{"name": "f", "arguments": '{"s": "a}b", "n": {"k": [1, 2]}}'}, {"name": "g", "arguments": "{}"}])
    for step in (1, 2, 3, 7, len(reply)):
        content, calls = summary(parse(reply, step))
        assert (content, calls) == expected, step
        assert all(json.loads(call["arguments"]) is not None for call in calls)


def test_a_call_written_arguments_first_is_given_out_whole_at_its_close():
    content, calls = summary(parse('<tool_call>{"arguments": {"q": "tea"}, "name": "search"}</tool_call>'))
    assert content == "" and calls == [{"name": "search", "arguments": '{"q": "tea"}'}]


def test_text_that_only_looks_like_markup_stays_content():
    for text in ("use a <toolbox> here", "<tool_call>not json</tool_call>", "ends with <tool_ca"):
        assert summary(parse(text)) == (text, [])


def test_the_prompt_lists_the_tools_and_renders_earlier_calls_and_results():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    rendered = tools.render(messages, [weather])
    assert rendered[0]["content"].startswith("Be brief.\n\n") and json.dumps(weather) in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert rendered[3] == {"role": "tool", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    assert tools.render(messages[1:2], []) == messages[1:2]
