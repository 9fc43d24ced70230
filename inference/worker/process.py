"""The worker process's life, as Celery's signals tell it: every model loaded before the first
task (the sweeper started once they are), its heartbeats marked draining when it is asked to
stop and removed once it has, and each prefetched request marked so its readers know whom to ask."""

import logging
import os
import threading

from celery.signals import task_received, worker_ready, worker_shutdown, worker_shutting_down
from celery.worker import state as worker_state

from inference import lifecycle, registry, streamlog
from inference.worker.beats import drain_own_beats, forget_own_beats, forget_stopped_here
from inference.worker.engines import engine_loop, serves
from inference.worker.sweeper import Sweeper

log = logging.getLogger(__name__)


@worker_ready.connect
def load_models(**kwargs):
    # Load every model before the first task arrives, once per worker process (threads pool).
    # Celery's SIGTERM and SIGQUIT handlers only set a flag that its main loop reads, and this
    # handler holds the main thread: the load runs in a thread while this one watches the flag.
    # Celery logs and swallows a signal handler's exception; a worker without its model must
    # not stay up taking tasks, so it exits.
    log.info("loading the models: %s", ", ".join(registry.names()))
    failed = []
    loading = threading.Thread(target=load_every_model, args=(failed,), name="load models", daemon=True)
    loading.start()
    while loading.is_alive():
        loading.join(0.2)
        if worker_state.should_stop is not None or worker_state.should_terminate is not None:
            log.warning("asked to stop while loading the models: stopping before taking any task")
            os._exit(0)
    if failed:
        log.critical("the worker could not load its models", exc_info=failed[0])
        os._exit(3)
    Sweeper().start()


def load_every_model(failed):
    try:
        forget_stopped_here(streamlog.sync_client())
        for name in registry.names():
            engine_loop(name)
    except Exception as exc:
        failed.append(exc)


@worker_shutting_down.connect
def begin_draining(**kwargs):
    # Sent from Celery's SIGTERM, SIGQUIT and SIGINT handlers, before the drain.
    try:
        drain_own_beats(streamlog.sync_client())
    except Exception:  # Redis away: admission cannot queue anything either
        log.warning("could not mark this worker's heartbeats draining", exc_info=True)


@worker_shutdown.connect
def stop_beating(**kwargs):
    # After the warm shutdown's drain: the requests it ran have ended.
    try:
        forget_own_beats(streamlog.sync_client())
    except Exception:  # Redis away: the beats run out within TOKSTREAM_WORKER_TTL anyway
        log.warning("could not remove this worker's heartbeats", exc_info=True)


@task_received.connect
def note_prefetched(request=None, **kwargs):
    # Prefetched, not yet running: should this worker die, the request's readers must know.
    try:
        mark_prefetched(request.kwargs["request_id"], request.kwargs["model"])
    except Exception:  # the request still runs; its readers just learn less
        log.warning("could not mark a prefetched request", exc_info=True)


def mark_prefetched(request_id, model):
    if serves(model):
        lifecycle.mark_prefetched(streamlog.sync_client(), request_id, engine_loop(model).worker_id)
