"""The Celery worker: the generate task, local runs, the engine threads, heartbeats, the sweeper, the process's life, the upstream relay, and the engine."""
