"""Tool calls in the Hermes convention that small open models follow.

The prompt lists the tools inside <tools></tools> and asks for each call as
<tool_call>{"name": ..., "arguments": {...}}</tool_call>. While the reply streams, ToolCallParser
turns such a call into OpenAI's tool-call deltas: first the call's id and name, then fragments
of its arguments as the model writes them, never a character of the surrounding markup.
"""

import json
import re
import uuid

from inference.protocol.text import partial_tail

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
SYSTEM = (
    (
        "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. "
        "You may call one or more functions to assist with the user query. "
        "Don't make assumptions about what values to plug into functions. Here are the available tools: "
    )
    + """<tools>
{tools}
</tools>
For each function call return a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
)


def render(messages, tools):
    """Chat messages as plain turns the chat template can take: the tools in the system turn,
    earlier calls as <tool_call> text, tool results as <tool_response> turns."""
    rendered = [render_message(m) for m in messages]
    if not tools:
        return rendered
    listing = SYSTEM.format(tools="\n".join(json.dumps(tool) for tool in tools))
    if rendered[0]["role"] == "system":
        return [{"role": "system", "content": f"{rendered[0]['content']}\n\n{listing}"}, *rendered[1:]]
    return [{"role": "system", "content": listing}, *rendered]


def render_message(message):
    content = message["content"]
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = [f"{OPEN}\n{json.dumps(call)}\n{CLOSE}" for call in message.get("tool_calls", [])]
    return {"role": message["role"], "content": "\n".join(filter(None, [content, *calls]))}


class ToolCallParser:
    """Feed text deltas; get ("content", text), ("call", index, id, name) and
    ("arguments", index, fragment) events."""

    def __init__(self):
        self.buffer = ""
        self.inside = False
        self.calls = 0  # calls begun
        self.head = None  # (end of the head in the buffer) once the call's name is known
        self.sent = 0  # argument characters already given out
        self.space = ""  # blank text after a call: given out only if more text follows

    def feed(self, text):
        self.buffer += text
        events = []
        while self._advance(events):
            pass
        return events

    def finish(self):
        """The reply ended: a call left open gives out what it has; stray markup is content."""
        events = []
        if self.inside and self.head is not None:
            events += self._arguments(self.buffer)
        elif self.inside:
            events += self._content(OPEN + self.buffer)
        elif self.buffer:
            events += self._content(self.buffer)
        self.buffer, self.inside = "", False
        return events

    def _content(self, text):
        """Text, but blank text next to calls (the newlines between them) only if more follows:
        a reply of calls alone has no content, as OpenAI's."""
        if self.calls and not text.strip():
            self.space += text
            return []
        text, self.space = self.space + text, ""
        return [("content", text)]

    def _advance(self, events):
        """One move of the state machine; False when it needs more text."""
        if not self.inside:
            return self._outside(events)
        end = self.buffer.find(CLOSE)
        body = self.buffer if end < 0 else self.buffer[:end]
        if self.head is None:
            self._read_head(body, events)
        if end < 0:
            if self.head is not None:
                events += self._arguments(body)
            return False
        events += self._close(body)
        self.buffer, self.inside = self.buffer[end + len(CLOSE) :], False
        return True

    def _outside(self, events):
        at = self.buffer.find(OPEN)
        cut = at if at >= 0 else len(self.buffer) - partial_tail(self.buffer, [OPEN])
        if cut:
            events += self._content(self.buffer[:cut])
        if at < 0:
            self.buffer = self.buffer[cut:]
            return False
        self.buffer, self.inside, self.head, self.sent = self.buffer[at + len(OPEN) :], True, None, 0
        return True

    def _read_head(self, body, events):
        match = HEAD.match(body)
        if match:
            self.head = match.end()
            events.append(self._begin(json.loads(match.group(1))))

    def _begin(self, name):
        self.calls += 1
        return ("call", self.calls - 1, f"call_{uuid.uuid4().hex[:24]}", name)

    def _arguments(self, body):
        """Argument text not given out yet. Hold back from the last "}" on: it may be the one
        that closes the call's object rather than the arguments (at the close, it is)."""
        if not self.sent:  # the space after "arguments": is not part of them
            self.head += len(body[self.head :]) - len(body[self.head :].lstrip())
        arguments = body[self.head :]
        last = arguments.rfind("}")
        end = max(last if last >= 0 else len(arguments), self.sent)
        fragment, self.sent = arguments[self.sent : end], end
        return [("arguments", self.calls - 1, fragment)] if fragment else []

    def _close(self, body):
        if self.head is not None:
            return self._arguments(body)
        try:  # written in another order: give it out whole, if it is a call at all
            call = json.loads(body)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError):
            return self._content(f"{OPEN}{body}{CLOSE}")
        return [self._begin(name), ("arguments", self.calls - 1, json.dumps(arguments))]
