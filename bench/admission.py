"""What admitting one chat request costs the web process, in its own CPU: the key's lookup, the
request parsed, its prompt counted, its budget held, its log opened and its task sent, as a
burst's requests each pay before their first token (issue 22). In this process, on real Redis
and SQLite, with no worker: a worker's heartbeat is written so that admission takes requests,
and each request leaves the queue again once admitted.

    .venv/bin/python bench/admission.py [--requests 64] [--rounds 5] [--profile]
"""

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import serving  # noqa: E402  (bench/serving.py)

serving.setup("admission", 11)

from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402

from billing.models import ApiKey  # noqa: E402
from inference import backends, streamlog  # noqa: E402
from inference.gateway.auth import required_owner  # noqa: E402
from inference.gateway.sse import admit_in_pool  # noqa: E402
from inference.protocol import chat_request  # noqa: E402

MODEL = "smollm2-135m-instruct"


def admit_one(authorization, n):
    """What the chat endpoint does before it streams, but reading the body."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": serving.question(n)}], "stream": True, "temperature": 0, "max_tokens": 64}
    owner = required_owner(authorization)
    chat = chat_request.parse(json.dumps(body).encode(), "application/json", backends.CATALOG)
    admitted = admit_in_pool(chat, owner)
    streamlog.leave_queue(streamlog.sync_client(), MODEL, admitted.request_id)


def cpu_per_request(authorization, first, count):
    started = time.process_time()
    for n in range(first, first + count):
        admit_one(authorization, n)
    return (time.process_time() - started) / count * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="admitted in each round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="then one more round under cProfile, its top functions")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    _, secret = ApiKey.issue("bench", user=User.objects.create_user("bench"))
    authorization = f"Bearer {secret}"
    client = streamlog.sync_client()
    streamlog.heartbeat(client, "bench:1:boot:cpu", MODEL)
    backends.warm_tokenizers()
    try:
        admit_one(authorization, 0)  # the first request's imports and connections
        rounds = [cpu_per_request(authorization, 1 + r * args.requests, args.requests) for r in range(args.rounds)]
        print(
            f"admission: {statistics.median(rounds):.2f} ms CPU a request (median of {args.rounds} rounds of {args.requests}; each {', '.join(f'{r:.2f}' for r in rounds)})"
        )
        if args.profile:
            profile = cProfile.Profile(time.process_time)
            profile.runcall(cpu_per_request, authorization, 1 + args.rounds * args.requests, args.requests)
            pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    finally:
        client.flushdb()  # this benchmark's own Redis database: its logs and its Celery queue


if __name__ == "__main__":
    main()
