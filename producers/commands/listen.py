"""Check that an HTTP command can listen on its address before it starts serving.

uvicorn reports an address it cannot bind as a log line and exits with its own code 3
(which batchd uses for "Redis failed") after the application has started and connected to
Redis; the dashboard then waits for its background tasks. Binding once up front gives one
message that names the address and the fix, and exit code 2.
"""

from __future__ import annotations

import errno
import socket

_FIXES = {
    errno.EADDRINUSE: "another program listens there (an earlier gateway or dashboard?): "
    "stop it, or choose another --port",
    errno.EADDRNOTAVAIL: "no network interface of this machine has that address: give "
    "127.0.0.1, 0.0.0.0 or one of its own addresses as --host",
    errno.EACCES: "ports below 1024 need privileges: choose a --port of 1024 or above",
}


def listen_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (one line with the fix), or None if it can.

    The socket is bound as uvicorn binds it (SO_REUSEADDR) and closed at once."""
    where = f"{host}:{port}"
    if not 0 <= port <= 65535:
        return f"cannot listen on {where}: a port is a number from 1 to 65535"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return f"cannot listen on {where}: {host!r} is not an address of this machine ({exc})"
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            fix = _FIXES.get(exc.errno or 0, "choose another --host or --port")
            return f"cannot listen on {where}: {exc.strerror or exc}; {fix}"
    return None
