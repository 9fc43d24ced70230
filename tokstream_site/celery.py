import logging
import os

from celery import Celery
from celery.signals import task_received, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")

app = Celery("tokstream_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def load_models(**kwargs):
    # Load every model before the first task arrives, once per worker process (threads pool).
    # Celery logs and swallows a signal handler's exception; a worker without its model must
    # not stay up taking tasks, so it exits.
    from inference import registry
    from inference.worker import Sweeper, engine_loop

    try:
        for name in registry.names():
            engine_loop(name)
    except Exception:
        logging.getLogger(__name__).critical("the worker could not load its models", exc_info=True)
        os._exit(3)
    Sweeper().start()


@task_received.connect
def reserve_request(request=None, **kwargs):
    # Prefetched, not yet running: should this worker die, the request's readers must know.
    from inference.worker import reserve

    try:
        reserve(request.kwargs["request_id"], request.kwargs["model"])
    except Exception:  # the request still runs; its readers just learn less
        logging.getLogger(__name__).warning("could not mark a prefetched request", exc_info=True)
