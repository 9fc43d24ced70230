"""A TCP proxy a test can cut: every open connection through it is closed at once, as a
network failure would, while new connections keep working."""

import socket
import threading


class CuttableProxy:
    def __init__(self, target_port):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.open = set()
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self.pump, args=(source, sink), daemon=True).start()

    def pump(self, source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self.drop(source, sink)

    def drop(self, *sockets):
        for sock in sockets:
            with self.lock:
                self.open.discard(sock)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def cut(self):
        """Close every connection that is open now; returns how many there were."""
        with self.lock:
            sockets = list(self.open)
        self.drop(*sockets)
        return len(sockets) // 2

    def close(self):
        self.listener.close()
        self.cut()
