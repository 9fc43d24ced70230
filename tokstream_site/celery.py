import os

from celery import Celery
from celery.signals import worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")

app = Celery("tokstream_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def load_models(**kwargs):
    # Load every model before the first task arrives, once per worker process (threads pool).
    from inference import registry
    from inference.worker import engine_loop

    for name in registry.names():
        engine_loop(name)
