import signal
import subprocess
import sys
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.utils.crypto import get_random_string

from tokstream_site import processes

WATCH_SECONDS = 0.5  # how often the children are checked: one that exits stops them all
STOP_GRACE_SECONDS = 10  # a child still running this long after SIGTERM is killed


class Command(BaseCommand):
    help = "Run the whole service in the foreground: Redis if none answers, Daphne and a worker."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args, host, port, **options):
        self.ensure_superuser()
        # A SIGTERM (say, from a process manager) stops the children too, as Ctrl-C does.
        signal.signal(signal.SIGTERM, lambda *args: sys.exit(0))
        children = [p for p in [processes.start_redis(settings.REDIS_URL)] if p]
        children.append(subprocess.Popen(processes.worker_command(settings.TOKSTREAM_MAX_RUNNING)))
        children.append(subprocess.Popen(processes.daphne_command(host, port)))
        self.stdout.write(self.style.SUCCESS(f"tokstream on http://{host}:{port}/ (Ctrl-C stops it)"))
        try:
            while all(child.poll() is None for child in children):
                time.sleep(WATCH_SECONDS)
        except KeyboardInterrupt:
            pass
        finally:
            stop(children)

    def ensure_superuser(self):
        users = get_user_model().objects
        if users.filter(is_superuser=True).exists():
            return
        password = get_random_string(20)
        users.create_superuser("admin", "", password)
        self.stdout.write(self.style.WARNING(f"Created superuser 'admin' with password {password} (shown only now)."))


def stop(children):
    for child in reversed(children):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
