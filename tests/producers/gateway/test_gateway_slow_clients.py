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
    closed_after: list[float] = []

    def trickle() -> None:
        sock = connect(strict.url)
        started = time.monotonic()
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        try:
            for byte in request:
                if stop.is_set():
                    return
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:
            closed_after.append(time.monotonic() - started)  # cut off
        finally:
            sock.close()

    slow = [threading.Thread(target=trickle) for _ in range(50)]
    for thread in slow:
        thread.start()
    try:
        answered = []
        deadline = time.monotonic() + 2.5 * HEADER_TIMEOUT_S
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert httpx.get(f"{strict.url}/health/live", timeout=2).status_code == 200
            answered.append(time.monotonic() - started)
            time.sleep(0.05)
        assert max(answered) < 0.5, answered
        for thread in slow:
            thread.join(10)
    finally:
        stop.set()
    assert len(closed_after) == 50, closed_after
    assert all(HEADER_TIMEOUT_S <= t < HEADER_TIMEOUT_S + 1.5 for t in closed_after), closed_after


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
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 1
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
    assert 1.5 < time.monotonic() - started < 5
