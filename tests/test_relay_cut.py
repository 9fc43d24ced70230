"""The relay's cut of an upstream connection when its client leaves, over plain TCP and over TLS
(as a vendor's API is reached): a request waiting on a silent upstream ends at once, and the
upstream sees its connection close. End to end, with the stand-in: tests/test_upstream.py."""

import select
import socket
import ssl
import subprocess
import threading
import time
import uuid

import httpx
import pytest

from inference import streamlog
from inference.worker import slots
from inference.worker.relay import CancelWatch

CANCEL_AFTER = 1.0  # seconds of silence before the client leaves


class SilentServer:
    """Reads a request and never answers; notes when its client's connection closed."""

    def __init__(self, context=None):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.context, self.closed_at = context, None
        scheme = "https" if context else "http"
        self.url = f"{scheme}://127.0.0.1:{self.listener.getsockname()[1]}/v1/chat/completions"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        connection, _ = self.listener.accept()
        if self.context:
            connection = self.context.wrap_socket(connection, server_side=True)
        connection.recv(65536)  # the request
        while True:
            readable, _, _ = select.select([connection], [], [], 0.05)
            if readable and not connection.recv(1):
                self.closed_at = time.monotonic()
                return


@pytest.fixture
def tls_context(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    command = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1"]
    subprocess.run(command, check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


@pytest.fixture
def slot(redis_client):
    held = slots.Slot(redis_client, f"test-cut-{uuid.uuid4().hex[:8]}", f"r-cut-{uuid.uuid4().hex[:8]}", 1, time.time())
    assert held.wait(lambda: False)
    yield held
    held.release()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_cancel_cuts_a_request_its_upstream_is_silent_on(redis_client, slot, tls, request):
    server = SilentServer(request.getfixturevalue("tls_context") if tls else None)
    with CancelWatch(redis_client, slot.request_id, slot) as watch:
        threading.Timer(CANCEL_AFTER, streamlog.cancel, args=(redis_client, slot.request_id)).start()
        started = time.monotonic()
        with pytest.raises(httpx.HTTPError), httpx.Client(verify=False, timeout=httpx.Timeout(10, read=30)) as http:
            http.post(server.url, json={"messages": []}, extensions={"trace": watch.trace})
        ended = time.monotonic()
    assert watch.cancelled and watch.delivered  # the upstream had the whole request: its prompt is billed
    assert ended - started < CANCEL_AFTER + 1, "the read waited on the silent upstream"
    deadline = time.monotonic() + 2
    while server.closed_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.closed_at is not None and server.closed_at - started < CANCEL_AFTER + 1
