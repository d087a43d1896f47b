"""Connections are bounded: 1,000 idle sockets and 300 clients sending their request head a byte at a
time neither cost a thread each nor stall `/health`, and the server closes them once the client
timeout passes (408 to those that started a request)."""

from __future__ import annotations

import http.client
import json
import resource
import socket
import threading
import time
from typing import Any, Iterator

import pytest

from tests.serving import live_server

pytestmark = pytest.mark.multiprocess  # every test here starts a live server with a worker process

# The server's --client-timeout-s here. Four waits below last about as long as it (the slow-body test
# waits twice), so it is short; a request sent whole (every /health probe) is read as soon as it
# arrives, far inside it even on loaded cores, and the slow heads would still take 20 s.
TIMEOUT_S = 2.5


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, Any]]:
    # Emulated 50x slow (a token per ~0.05 s here): a 50-token stream still runs when its client leaves.
    with live_server(client_timeout_s=TIMEOUT_S, emulate_slowdown="0:50") as (port, svc):
        yield port, svc


@pytest.fixture(scope="module")
def port(server: tuple[int, Any]) -> int:
    return server[0]


def health(port: int, timeout_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert json.loads(resp.read())["status"] == "ok"
        return resp.status, time.monotonic() - t0
    finally:
        conn.close()


def answer(port: int, request: bytes) -> bytes:
    """Everything the server sends on a fresh connection after `request`, until it closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S + 20) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def closed_by_server(s: socket.socket) -> bool:
    """The server ended the connection: EOF (after any answer it sent) or a reset."""
    s.setblocking(False)  # (select() cannot take descriptors past 1024)
    try:
        while s.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


@pytest.mark.timeout(180)
def test_idle_and_slow_clients_neither_take_threads_nor_stall_health(port: int) -> None:
    n_idle, n_slow = 1000, 300
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (n_idle + n_slow) + 256  # both ends of every connection live in this process
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    idle: list[socket.socket] = []
    slow: list[socket.socket] = []
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"s" * 200 + b"\r\n\r\n"
    threads: list[int] = []
    latencies: list[float] = []
    try:
        for _ in range(n_idle):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        for _ in range(n_slow):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.setblocking(False)
            slow.append(s)
        start = time.monotonic()
        sent = 0
        # A byte per slow client every 0.1 s: their heads would take 20 s, well past the server's timeout.
        while time.monotonic() - start < TIMEOUT_S + 3.0:
            for s in slow:
                if sent < len(head):
                    try:
                        s.send(head[sent : sent + 1])
                    except (BlockingIOError, ConnectionResetError, BrokenPipeError):
                        pass  # closed by the server once its timeout passed
            sent += 1
            threads.append(threading.active_count())
            status, dt = health(port, timeout_s=10)
            assert status == 200
            latencies.append(dt)
            time.sleep(0.1)
        print(
            f"\nthreads max {max(threads)}, /health latency max {max(latencies):.3f} s "
            f"median {sorted(latencies)[len(latencies) // 2]:.3f} s over {len(latencies)} probes"
        )
        assert max(threads) < 40, f"{max(threads)} threads for {n_idle + n_slow} connections"
        # Every idle and slow connection is closed by the server once the client timeout passes.
        deadline = time.monotonic() + TIMEOUT_S + 20.0
        remaining = idle + slow
        while remaining and time.monotonic() < deadline:
            remaining = [s for s in remaining if not closed_by_server(s)]
            time.sleep(0.2)
        assert not remaining, f"{len(remaining)} of {n_idle + n_slow} connections still open"
        assert health(port, timeout_s=10)[0] == 200
    finally:
        for s in idle + slow:
            s.close()


def test_a_slow_request_head_gets_408_as_json(port: int) -> None:
    data = answer(port, b"GET /health HTTP/1.1\r\nX-Partial: ")
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"application/json" in head, data
    assert "did not arrive within" in json.loads(body)["error"]["message"]


def test_a_slow_body_gets_408_and_an_idle_keep_alive_connection_is_closed_silently(port: int) -> None:
    data = answer(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 50\r\n\r\n{")
    assert data.startswith(b"HTTP/1.1 408 ") and b'"error"' in data, data
    data = answer(port, b"GET /health HTTP/1.1\r\n\r\n")
    assert data.count(b"HTTP/1.1 ") == 1 and data.startswith(b"HTTP/1.1 200 "), data  # then closed, no 408


def test_a_stream_whose_client_leaves_is_cancelled(server: tuple[int, Any]) -> None:
    port, svc = server
    body = json.dumps({"model": "hybridpar", "prompt": "def ", "max_tokens": 50, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while b"data: " not in data:  # the first token has been streamed
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    deadline = time.monotonic() + 60  # its replica is told, frees the place and counts it
    while (svc.counters["requests_cancelled"] < 1 or svc.router.where) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert svc.counters["requests_cancelled"] == 1 and not svc.router.where and not svc.inflight
    assert svc.counters["completion_tokens_total"] < 50
