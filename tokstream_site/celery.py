import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")

app = Celery("tokstream_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Only a worker imports the task module (and with it the engine); the web process sends
# tasks by name and never does.
app.conf.imports = ("inference.worker.tasks",)
