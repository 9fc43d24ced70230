"""The inference app: a folder for each process that runs its code, and what they share.

- `gateway/` — the web process (Daphne): the streaming ASGI apps (`sse.py`, routed in
  `routing.py`), admission (count, limits, budget hold, queue), the API's other views, auth.
- `chat/` — the web process too: the chat page's views and its conversations.
- `worker/` — the Celery worker, a concern a module: the task (`tasks.py`), a local request's
  run (`local.py`), the engine threads (`engines.py`), heartbeats (`beats.py`), the sweeper
  (`sweeper.py`), the process's life as Celery signals it (`process.py`), the upstream relay
  (`relay.py`, `slots.py`) and the engine itself (`engine/`: plain Python and torch).
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

Words, each with one meaning in the code and the docs:
- *admit*: check a request, hold its budget, queue it (gateway/admission.py); after that it
  ends exactly once.
- *claim*: a worker takes a queued request to run it (lifecycle.claim); a second delivery of
  the task finds it claimed.
- *prefetched*: Celery handed the task to a worker that has not started it (its readers then
  know whom to ask; lifecycle.mark_prefetched).
- *verdict*: why a request is over, or that it is not (lifecycle.verdict); *end*: the one
  ending that follows, ledger row first (lifecycle.end).
- *relay*: forward an upstream model's stream into the request's log (worker/relay.py); a
  *relayed* request is one for an upstream. A local request's outputs are *streamed* into its
  log (worker/local.py), and the web *sends* the log as SSE (gateway/sse.py).
- *hold*: the worst case set aside on a request's budgets at admission, *released* at its end
  (billing/budgets.py).
- *reserve*: set KV cache blocks aside for a request (engine/kv_manager.py); the engine's
  scheduler *starts* a waiting request once its blocks are reserved (never "admits": that is
  the gateway's).
- *settle*: give a chat page's reply its final text, calls and ending from the log (replies.py).
- *beat*: a worker's heartbeat (worker/beats.py); *drain*: a worker asked to stop finishes what
  it runs and takes nothing new.
"""
