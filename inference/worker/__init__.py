"""The Celery worker: the generate task, the engine loops and sweeper, the upstream relay, and the engine."""
