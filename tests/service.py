"""Start the service's real processes for a test session."""

import json
import os
import subprocess
from pathlib import Path

import httpx
from django.conf import settings

from tests.settings import free_port
from tests.waiting import eventually
from tokstream_site import processes

ROOT = Path(__file__).resolve().parent.parent


def database_url(db, application_name):
    """The test database, with PostgreSQL sessions named after the service that opens them."""
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    user = db["USER"] or ""
    if db["PASSWORD"]:
        user += f":{db['PASSWORD']}"
    return f"postgres://{user}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}?application_name={application_name}"


class LiveService:
    """Daphne and Celery worker processes (one of each unless asked), sharing one database."""

    def __init__(self, db_settings, daphnes=1, workers=1, **env):
        self.ports = [free_port() for _ in range(daphnes)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.url, self.port = self.urls[0], self.ports[0]
        self.workers = workers
        self.application_name = f"tokstream-test-{self.port}"
        self.env = {**os.environ, "DATABASE_URL": database_url(db_settings, self.application_name), "PYTHONUNBUFFERED": "1", **env}
        self.concurrency = int(self.env.get("TOKSTREAM_MAX_RUNNING", settings.TOKSTREAM_MAX_RUNNING))  # as `manage.py serve` runs it
        self.logs = ROOT / ".cache" / "test-logs" / str(self.port)
        self.children = []

    def start(self):
        self.logs.mkdir(parents=True, exist_ok=True)
        for n in range(self.workers):
            self.spawn(f"worker-{n}" if n else "worker", processes.worker_command(self.concurrency, hostname=f"test-{self.port}-{n}@%h"))
        for n, port in enumerate(self.ports):
            self.spawn(f"daphne-{n}" if n else "daphne", processes.daphne_command("127.0.0.1", port))
        self.wait_healthy(timeout=120)

    def spawn(self, name, command):
        log = open(self.logs / f"{name}.log", "w")
        self.children.append(subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def wait_healthy(self, timeout):
        """Until every web process answers and every worker has its model loaded."""
        eventually(self.ready, timeout, interval=0.3, message=f"the service did not become healthy; see {self.logs}")

    def ready(self):
        for child in self.children:
            if child.poll() is not None:
                raise RuntimeError(f"a service process exited early; see {self.logs}")
        return all(self.healthy(url) for url in self.urls)

    def healthy(self, url):
        try:
            response = httpx.get(f"{url}/healthz", timeout=2)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        served = response.json()["checks"]["workers"]["models"]  # model -> engines serving it
        return all(served.get(name, 0) >= self.workers for name in json.loads(self.env["TOKSTREAM_MODELS"]))

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

    return eventually(lambda: UsageEntry.objects.filter(**fields).first(), seconds, interval=0.1, message=f"no ledger entry with {fields}")
