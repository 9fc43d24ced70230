"""The sweeper: a thread of every worker process that ends, every SWEEP_SECONDS, the requests
nobody else will (inference.lifecycle.sweep)."""

import logging
import threading
import time

from django.db import close_old_connections

from inference import lifecycle, streamlog

log = logging.getLogger(__name__)


class Sweeper(threading.Thread):
    """Ends the requests nobody else will, every lifecycle.SWEEP_SECONDS."""

    def __init__(self):
        super().__init__(daemon=True, name="sweeper")

    def run(self):
        while True:
            time.sleep(lifecycle.SWEEP_SECONDS)
            close_old_connections()
            try:
                ended = lifecycle.sweep(streamlog.sync_client())
                if ended:
                    log.warning("the sweeper ended %d requests nobody else would", ended)
            except Exception:  # Redis or the database away: look again later
                log.exception("sweeping pending requests failed")
