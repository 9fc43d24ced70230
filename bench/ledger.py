"""Ledger throughput and export memory, on a scratch database of its own.

    DATABASE_URL=postgres://USER@HOST:5432/NAME .venv/bin/python bench/ledger.py [--rows 100000]

(1) Entries written per second through `billing.ledger.record` (priced, hash-chained, one
    transaction each) by 1 and by 4 concurrent writer threads: the ratio shows what the chain's
    lock costs. (2) Peak memory of the process while the REST export streams every entry as
    CSV, for a tenth of the rows and then for all of them: a flat export grows by about the
    same for both.
"""

import argparse
import os
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")

import django  # noqa: E402

django.setup()

from django.db import connection, connections  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402

from billing import ledger  # noqa: E402
from billing.models import ApiKey, UsageEntry  # noqa: E402


def write(count, prefix):
    now = time.time()
    for n in range(count):
        ledger.record(
            f"{prefix}-{n}", "stop", model="m", tokenizer="t", prompt_tokens=100, completion_tokens=n % 500,
            received_at=ledger.as_datetime(now), finished_at=ledger.as_datetime(now + 1),
        )  # fmt: skip
    connections.close_all()


def entries_per_second(threads, per_thread):
    workers = [threading.Thread(target=write, args=(per_thread, f"w{threads}-{t}")) for t in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return threads * per_thread / (time.perf_counter() - start)


def fill(rows, prefix):
    """Bulk rows for the export (they skip the chain: only reading them is measured)."""
    now = ledger.as_datetime(time.time())
    batch = [
        UsageEntry(request_id=f"{prefix}-{n}", model="m", tokenizer="t", prompt_tokens=100, completion_tokens=n % 500, finish_reason="stop", status="completed", received_at=now, finished_at=now)
        for n in range(rows)
    ]  # fmt: skip
    UsageEntry.objects.bulk_create(batch, batch_size=5000)


def export_growth(client, auth):
    """(growth of the peak RSS in MB, lines) while streaming every entry as CSV."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    response = client.get("/api/ledger/entries/", {"format": "csv"}, **auth)
    lines = sum(chunk.count(b"\n") for chunk in response.streaming_content)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--writes", type=int, default=400)
    args = parser.parse_args()
    setup_test_environment()
    name = connection.creation.create_test_db(verbosity=0)
    try:
        print(f"database {connection.vendor}")
        one = entries_per_second(1, args.writes)
        four = entries_per_second(4, args.writes // 4)
        print(f"ledger.record: 1 writer {one:.0f} entries/s, 4 writers {four:.0f} entries/s: x{four / one:.2f}")
        _, raw = ApiKey.issue("bench", scopes="ledger:read:all")
        auth, client = {"HTTP_AUTHORIZATION": f"Bearer {raw}"}, Client()
        warm, warm_lines = export_growth(client, auth)  # first use of the export path
        print(f"CSV export of the {warm_lines - 1} written entries (warm-up) raised the peak RSS by {warm:.1f} MB")
        fill(args.rows // 10 - 2 * args.writes, "small")
        small, small_lines = export_growth(client, auth)
        fill(args.rows - args.rows // 10, "large")
        large, large_lines = export_growth(client, auth)
        print(f"CSV export: {small_lines - 1} entries raised it by {small:.1f} MB more, then {large_lines - 1} entries by {large:.1f} MB more")
    finally:
        connections.close_all()
        connection.creation.destroy_test_db(name, verbosity=0)


if __name__ == "__main__":
    main()
