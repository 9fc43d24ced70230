"""A small SSE client for tests: events as (id, data) with data decoded from JSON."""

import json

import httpx

MODEL = "smollm2-135m-instruct"


def chat_body(content, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def events(response, on_comment=None):
    """Yield (event id or None, data) for each event of a streaming response; comment lines
    (keep-alives) call on_comment."""
    event_id, data = None, []
    for line in response.iter_lines():
        if line.startswith(":") and on_comment:
            on_comment()
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            payload = "\n".join(data)
            yield event_id, payload if payload == "[DONE]" else json.loads(payload)
            event_id, data = None, []


def stream_chat(service, key, body):
    with httpx.stream("POST", f"{service.url}/v1/chat/completions", json=body, headers=auth(key), timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(events(response))


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def content_of(chunks):
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if isinstance(c, dict) and c["choices"])
