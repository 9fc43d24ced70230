"""Start the service's real processes for a test session."""

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.settings import free_port
from tokstream_site import processes

ROOT = Path(__file__).resolve().parent.parent


def database_url(db):
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    user = db["USER"] or ""
    if db["PASSWORD"]:
        user += f":{db['PASSWORD']}"
    return f"postgres://{user}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


class LiveService:
    def __init__(self, db_settings, **env):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "DATABASE_URL": database_url(db_settings), "PYTHONUNBUFFERED": "1", **env}
        self.logs = ROOT / ".cache" / "test-logs" / str(self.port)
        self.children = []

    def start(self):
        self.logs.mkdir(parents=True, exist_ok=True)
        self.spawn("worker", processes.worker_command(4, hostname=f"test-{self.port}@%h"))
        self.spawn("daphne", processes.daphne_command("127.0.0.1", self.port))
        self.wait_healthy(timeout=120)

    def spawn(self, name, command):
        log = open(self.logs / f"{name}.log", "w")
        self.children.append(subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def wait_healthy(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.children:
                if child.poll() is not None:
                    raise RuntimeError(f"a service process exited early; see {self.logs}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the service did not become healthy; see {self.logs}")

    def stop(self):
        for child in self.children:
            child.terminate()
        for child in self.children:
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()


def wait_for_entry(seconds, **fields):
    """The ledger entry the worker writes when a request ends, once it is there."""
    from billing.models import UsageEntry

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        entry = UsageEntry.objects.filter(**fields).first()
        if entry:
            return entry
        time.sleep(0.1)
    raise AssertionError(f"no ledger entry with {fields} after {seconds} s")
