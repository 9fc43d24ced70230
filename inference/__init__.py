"""The inference app: a folder for each process that runs its code, and what they share.

- `gateway/` — the web process (Daphne): the streaming ASGI apps (`sse.py`, routed in
  `routing.py`), admission (count, limits, budget hold, queue), the API's other views, auth.
- `chat/` — the web process too: the chat page's views and its conversations, which learn
  that a reply ended from the `request_finished` signal (`receivers.py`).
- `worker/` — the Celery worker: the task (`tasks.py`), the engine loops (`loops.py`), the
  upstream relay (`relay.py`) and the engine itself (`engine/`: plain Python and torch).
- `protocol/` — types and formats both processes agree on: log entries, the task payload,
  chunks and SSE frames, errors, tool-call text, and the request parser (which looks models
  up in the registry).
- Shared by both processes, at this level: `streamlog.py` (the Redis contract: keys, logs,
  queues, heartbeats), `lifecycle.py` (a request's claim and its one ending), `backends.py`
  (how each model kind is served and counted), `registry.py` and `model_files.py` (the
  configured models and their files), `metrics.py`, `signals.py`, `models.py`.

The web process never imports `worker/` (tests/test_architecture.py checks, lazy imports
included); it sends the task by name. One token's path, in five files: the ASGI route
(`gateway/routing.py`), the gateway's streaming app (`gateway/sse.py`), the Celery task
(`worker/tasks.py`), the engine's `step()` (`worker/engine/engine.py`), and the end
(`lifecycle.py`'s `end`).
"""
