"""Slow and large clients: headers trickled, bodies that never end, uploads past the limit.

Raw sockets on 127.0.0.1, every wait bounded: what a client that does not play by the
rules does to the gateway, and that the gateway keeps answering everyone else.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchd.config.sections import GatewaySettings
from batchd.producers.gateway.options import GatewayOptions

API_KEY = "sk-test-gateway"
HEADER_TIMEOUT_S = 1.0


@pytest.fixture
def strict(redis_url: str, daemon: Any, tmp_path: Path, start_gateway: Any) -> Iterator[Any]:
    """A gateway with small limits: 1 s for headers, 2 s for a body, 64 KiB files."""
    options = GatewayOptions(
        api_keys=[API_KEY],
        files_dir=tmp_path / "files",
        max_body_bytes=32 << 10,
        max_file_bytes=64 << 10,
        body_timeout_s=2.0,
    )
    server = GatewaySettings(header_timeout_s=HEADER_TIMEOUT_S)
    with start_gateway(redis_url, options, server) as gw:
        yield gw


def connect(url: str) -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def test_slow_headers_are_cut_off_while_health_keeps_answering(strict: Any) -> None:
    stop = threading.Event()
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    closed_at: list[float] = []  # when each slow client found itself cut off
    closed_after: list[float] = []

    def trickle(sock: socket.socket, started: float) -> None:
        try:
            for byte in request[1:]:
                if stop.is_set():
                    return
                time.sleep(0.05)
                sock.sendall(bytes([byte]))
        except OSError:
            closed_at.append(time.monotonic())
            closed_after.append(closed_at[-1] - started)  # cut off
        finally:
            sock.close()

    # Health is asked on one warm client: what is timed is the gateway, not a new
    # client's setup.
    with httpx.Client(base_url=strict.url, timeout=10) as health:
        assert health.get("/health/live").status_code == 200
        slow = []
        for _ in range(50):  # all connected and started before any trickles on
            sock = connect(strict.url)
            slow.append(threading.Thread(target=trickle, args=(sock, time.monotonic())))
            sock.sendall(request[:1])
        all_open = time.monotonic()
        for thread in slow:
            thread.start()
        try:
            answered: list[tuple[float, float]] = []  # (asked, answered)
            deadline = time.monotonic() + 2.5 * HEADER_TIMEOUT_S
            while time.monotonic() < deadline:
                asked = time.monotonic()
                assert health.get("/health/live").status_code == 200
                answered.append((asked, time.monotonic()))
                time.sleep(0.05)
            for thread in slow:
                thread.join(30)
        finally:
            stop.set()
    assert len(closed_after) == 50, closed_after
    # Answered while every slow client was connected and none cut off yet: a gateway
    # blocked behind them answers only once they are cut off, whatever the host's speed.
    first_cut = min(closed_at)
    during = [(a, b) for a, b in answered if a >= all_open and b < first_cut]
    assert during, (all_open, first_cut, answered)
    # Cut off at the header timeout; the whole trickle lasts ~11 s (216 bytes, 50 ms
    # apart), so the upper bound leaves a loaded host room and still tells them apart.
    assert all(HEADER_TIMEOUT_S <= t < HEADER_TIMEOUT_S + 5 for t in closed_after), closed_after


def test_a_late_header_gets_a_408_and_a_prompt_one_is_served(strict: Any) -> None:
    sock = connect(strict.url)
    try:
        sock.sendall(b"GET /health/live HTTP/1.1\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 408 ")
    finally:
        sock.close()
    sock = connect(strict.url)
    try:  # a keep-alive connection's second request has the same time for its headers
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(HEADER_TIMEOUT_S / 2)
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /health/live HTTP/1.1\r\n")  # ... and no more
        started = time.monotonic()
        assert read_answer(sock).startswith(b"HTTP/1.1 408 ")
        # Without a header timeout nothing answers: the socket's own 10 s timeout ends the
        # read. The bound leaves a loaded host room below that.
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 5
    finally:
        sock.close()


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def chunked_request(path: str, content_type: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()


def send_until_answered(
    sock: socket.socket, head: bytes, chunks: Iterator[bytes]
) -> tuple[int, bytes]:
    """Send ``head`` then chunks (HTTP chunked) until the server answers; (body bytes sent
    by then, the answer)."""
    sock.sendall(head)
    sent = 0
    for chunk in chunks:  # paced: the kernel's buffers never hold much of it
        if select.select([sock], [], [], 0.005)[0]:
            break  # an answer is waiting
        try:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            break  # the server closed: read its answer
        sent += len(chunk)
    return sent, read_answer(sock)


def test_a_chunked_upload_over_the_limit_is_refused_having_read_about_the_limit(
    strict: Any,
) -> None:
    boundary = "b0undary"
    form_head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'

    def body() -> Iterator[bytes]:
        yield form_head
        for _ in range(400):  # ~5 MiB, far past the 64 KiB + 1 MiB the body may have
            yield line * 160

    sock = connect(strict.url)
    try:
        sent, answer = send_until_answered(
            sock, chunked_request("/v1/files", f"multipart/form-data; boundary={boundary}"), body()
        )
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b'"param":"file"' in answer
    limit = (64 << 10) + (1 << 20)  # the file's limit and the form's allowance
    assert sent < limit + (256 << 10), sent  # plus what the sockets held in flight
    assert list(Path(strict.options.files_dir).glob("file-*")) == []


def test_a_chunked_json_body_over_the_limit_is_refused(strict: Any) -> None:
    def body() -> Iterator[bytes]:
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(400):
            yield b"a" * (16 << 10)

    sock = connect(strict.url)
    try:
        sent, answer = send_until_answered(
            sock, chunked_request("/v1/chat/completions", "application/json"), body()
        )
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413 ") and sent < (32 << 10) + (256 << 10), sent


def test_a_body_that_stops_coming_gets_a_408(strict: Any) -> None:
    sock = connect(strict.url)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {API_KEY}\r\n".encode()
            + b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
        )
        started = time.monotonic()
        answer = read_answer(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer
    # The 2 s body timeout; without one nothing answers before the socket's own 10 s
    # timeout, so the upper bound leaves a loaded host room and still tells them apart.
    assert 1.5 < time.monotonic() - started < 8
