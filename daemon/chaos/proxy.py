"""A TCP proxy between a daemon and its redis-server that can partition, cut, or lose
one reply: the network faults a deployment meets, with a real server behind them.

- ``pause()`` / ``resume()``: a partition. Bytes stop flowing both ways (they wait
  in the kernel and the proxy) and flow again, late, on resume, as after a network
  heals: a request sent during the pause reaches Redis afterwards.
- ``cut()``: every open connection is closed (a restart of a load balancer, say).
- ``lose_next_reply()``: the next reply from Redis is swallowed and its connection
  closed: Redis executed the command, the client never learns the outcome.

While Redis itself is down the proxy keeps listening and drops each connection it
cannot forward, so a client behind it sees what it would see without it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from batchd.daemon.redis_server import free_port

CHUNK = 65536


class Proxy:
    """Listens on 127.0.0.1:<free port>, forwards to ``target_port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._flowing = threading.Event()
        self._flowing.set()
        self._lose_reply = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _close(sock)

    def lose_next_reply(self) -> None:
        self._lose_reply.set()

    def close(self) -> None:
        self._closed = True
        self.resume()
        _close(self._listener)
        self.cut()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # Redis is down: the client sees a dropped connection, as it would
                _close(client)
                continue
            with self._lock:
                self._sockets += [client, server]
            for src, dst, replies in ((client, server, False), (server, client, True)):
                threading.Thread(
                    target=self._pump, args=(src, dst, replies), name="proxy-pump", daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                self._flowing.wait()
                if replies and self._lose_reply.is_set():
                    self._lose_reply.clear()
                    break
                dst.sendall(data)
        except OSError:
            pass
        _close(src)
        _close(dst)


@contextmanager
def proxy_to(target_port: int) -> Iterator[Proxy]:
    proxy = Proxy(target_port)
    try:
        yield proxy
    finally:
        proxy.close()


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
