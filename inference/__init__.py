"""The inference app: a folder for each process that runs its code, and what they share.

- `gateway/` — the web process (Daphne): the streaming ASGI apps (`sse.py`, routed in
  `routing.py`), admission (count, limits, budget hold, queue), the API's other views, auth.
- `chat/` — the web process too: the chat page's views and its conversations.
- `worker/` — the Celery worker: the task (`tasks.py`), the engine loops (`loops.py`), the
  upstream relay (`relay.py`) and the engine itself (`engine/`: plain Python and torch).
- `protocol/` — types and formats both processes agree on, importing nothing else of the
  project: log entries, what crosses Redis and Celery (`payloads.py`: the task, a request's
  metadata and state, a worker's heartbeat, the sampling parameters), chunks and SSE frames,
  errors, tool-call text, and the request parser (its caller hands it the models catalog).
- Shared by both processes, at this level: `streamlog.py` (the Redis contract: keys, logs,
  queues, heartbeats), `lifecycle.py` (whether a request is over, its claim and its one
  ending), `replies.py` (settles a chat page's reply on `request_finished`, wherever the request
  ended), `backends.py` (how each model kind is served and counted), `registry.py` and
  `model_files.py` (the configured models and their files), token counting (`counting.py`,
  `tiktoken_offline.py`), `metrics.py`, `signals.py`, `models.py`.

tests/test_architecture.py checks every direction, lazy imports included: the web never
imports `worker/` (it sends the task by name), nothing shared imports the web's folders, and
the engine reaches no Django, Celery or Redis. The path of one token, file by file:
docs/architecture.md.
"""
