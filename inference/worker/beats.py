"""A worker's heartbeats: each engine (or upstream relay) of this process says, every third of
TOKSTREAM_WORKER_TTL, that it serves its model, so /healthz, admission and readers can tell a
live worker from a dead one; at a drain they say "draining", at shutdown they are removed, and at
start-up the beats of this host's dead worker processes are forgotten."""

import logging
import os
import socket
import threading
import time
import uuid

from django.conf import settings

from inference import streamlog

log = logging.getLogger(__name__)
BOOT = uuid.uuid4().hex[:8]  # a restarted container may reuse the host name and the pid
STOPPED = threading.Event()  # the worker is shutting down: its engines beat no more
DRAINING = threading.Event()  # asked to stop: it finishes what it runs and takes nothing new
BEATS_PER_TTL = 3  # a beat every third of its lifetime: one late beat does not look like a death


def beat_interval():
    return settings.TOKSTREAM_WORKER_TTL / BEATS_PER_TTL


def worker_id(part):
    """This process's id for one of its engines (`part`: its device, or "upstream")."""
    return f"{socket.gethostname()}:{os.getpid()}:{BOOT}:{part}"


def own_beat(field):
    return field.startswith(worker_id(""))


def forget_own_beats(client):
    """At shutdown: this process serves nothing any more, so /healthz must not count it for
    the rest of its beats' TTL."""
    STOPPED.set()
    return streamlog.forget_workers(client, own_beat)


def drain_own_beats(client):
    """Asked to stop: Celery consumes no more tasks, so admission must send this worker none.
    Its beats go on, marked draining, for the requests it still runs."""
    DRAINING.set()
    return streamlog.drain_workers(client, own_beat)


def beat(client, worker_id, model, running=0, waiting=0):
    streamlog.heartbeat(client, worker_id, model, running, waiting, draining=DRAINING.is_set())
    if STOPPED.is_set():  # the shutdown removed the beats while this one was on its way
        forget_own_beats(client)


def forget_stopped_here(client):
    """At start-up: the beats of this host's worker processes that no longer run (one killed
    before this one started) would keep /healthz answering 200 while this one loads. A
    restarted container gives its new worker the pid of the old one: a beat with this
    process's pid and another boot is the dead one's."""
    host, own = socket.gethostname(), os.getpid()

    def gone(field):
        name, pid, boot = (field.split(":") + ["", "", ""])[:3]
        return name == host and boot != BOOT and pid.isdigit() and (int(pid) == own or not process_alive(int(pid)))

    return streamlog.forget_workers(client, gone)


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class UpstreamBeat(threading.Thread):
    """An upstream model needs no engine, but readers and admission must know that this worker
    can relay it (and when the worker died): it beats like an engine."""

    def __init__(self, name, redis_client):
        super().__init__(daemon=True, name=f"upstream-{name}")
        self.name_of_model = name
        self.redis = redis_client
        self.worker_id = worker_id("upstream")

    def run(self):
        while not STOPPED.is_set():
            try:
                beat(self.redis, self.worker_id, self.name_of_model)
            except Exception:  # Redis went away: beat again later
                log.exception("heartbeat of upstream model %s failed", self.name_of_model)
            time.sleep(beat_interval())

    def load(self):
        return 0
