"""HTTP fuzz over raw sockets: every malformed request line, header, length, method and body gets a
JSON 4xx (or a 5xx other than 500) — never a stdlib HTML page, never a 500 — or, where HTTP allows
no answer, a clean close; and `/health` answers 200 between every two of them."""

from __future__ import annotations

import json
import socket
from typing import Any, Iterator

import pytest

from tests.serving import live_server


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with live_server(client_timeout_s=5) as (port, _):
        yield port


def exchange(
    port: int, raw: bytes, half_close: bool = False, timeout_s: float = 15.0
) -> tuple[int | None, dict[str, str], bytes]:
    """Send `raw`, read one response (status, lower-cased headers, body); (None, {}, b"") if the server
    closed without answering. `half_close` ends our side of the stream after `raw`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(raw)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before it read everything: read that answer
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            if not head:
                return None, {}, b""
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            n = int(headers.get("content-length", "0"))
            while len(body) < n and not raw.startswith(b"HEAD "):
                chunk = s.recv(65536)
                if not chunk:
                    break
                body += chunk
        except ConnectionResetError:
            return (None, {}, b"") if not data else (int(data.split()[1]), {}, b"")
    return int(lines[0].split()[1]), headers, body


def req(line: str | bytes, headers: list[str | bytes] = (), body: bytes = b"") -> bytes:
    def enc(x: str | bytes) -> bytes:
        return x if isinstance(x, bytes) else x.encode("latin-1")

    return b"".join([enc(line), b"\r\n", *(enc(h) + b"\r\n" for h in headers), b"\r\n", body])


def post(body: bytes, extra: list[str | bytes] = ()) -> bytes:
    return req("POST /v1/completions HTTP/1.1", [f"Content-Length: {len(body)}", *extra], body)


def completion(**kw: Any) -> bytes:
    return json.dumps({"model": "hybridpar", "prompt": "def ", "max_tokens": 2, **kw}).encode()


NUM = b'{"model": "hybridpar", "prompt": "x", "max_tokens": 1'
CASES: list[tuple[str, bytes, int | None, bool]] = [  # (name, bytes, expected status or None = closed, half-close)
    # request lines
    ("garbage", req("GARBAGE"), 400, False),
    ("method only", req("GET"), 400, False),
    ("http/0.9", req("GET /health"), 400, False),
    ("four parts", req("GET /health HTTP/1.1 extra"), 400, False),
    ("version 9.9", req("GET /health HTTP/9.9"), 505, False),
    ("version 2.0", req("GET /health HTTP/2.0"), 505, False),
    ("http2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, False),
    ("bad protocol", req("GET /health HTTX/1.1"), 400, False),
    ("lower-case protocol", req("GET /health http/1.1"), 400, False),
    ("version without minor", req("GET /health HTTP/1"), 400, False),
    ("version 1.1.1", req("GET /health HTTP/1.1.1"), 400, False),
    ("relative target", req("GET health HTTP/1.1"), 400, False),
    ("double space", req("GET  /health HTTP/1.1"), 400, False),
    ("tabs", req("GET\t/health\tHTTP/1.1"), 400, False),
    ("nul in method", req(b"G\x00T /health HTTP/1.1"), 400, False),
    ("control in target", req(b"GET /he\x01alth HTTP/1.1"), 400, False),
    ("non-ascii target", req(b"GET /\xff\xfe HTTP/1.1"), 400, False),
    ("bad method token", req("GE(T /health HTTP/1.1"), 400, False),
    ("long request line", req("GET /" + "a" * 10000 + " HTTP/1.1"), 414, False),
    ("tls hello", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(64)) + b"\r\n\r\n", 400, False),
    ("unterminated line", b"GET /health HTTP/1.1", 400, True),
    ("cr only", b"GET /health HTTP/1.1\r\r", 400, True),
    ("nothing", b"", None, True),
    ("blank lines only", b"\r\n\r\n\r\n\r\n\r\n\r\n\r\n\r\n\r\n\r\n", 400, True),
    # methods
    *(
        (f"{m} completions", req(f"{m} /v1/completions HTTP/1.1"), 405, False)
        for m in ("PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT", "FOO", "get")
    ),
    ("PUT health", req("PUT /health HTTP/1.1"), 405, False),
    ("DELETE models", req("DELETE /v1/models HTTP/1.1"), 405, False),
    ("HEAD health", req("HEAD /health HTTP/1.1"), 405, False),
    ("OPTIONS *", req("OPTIONS * HTTP/1.1"), 405, False),
    ("GET *", req("GET * HTTP/1.1"), 400, False),
    ("GET completions", req("GET /v1/completions HTTP/1.1"), 405, False),
    ("POST health", req("POST /health HTTP/1.1", ["Content-Length: 0"]), 405, False),
    ("unknown path", req("GET /nope?x=1 HTTP/1.1"), 404, False),
    # headers
    ("no colon", req("GET /health HTTP/1.1", ["NoColonHere"]), 400, False),
    ("space before colon", req("GET /health HTTP/1.1", ["Host : x"]), 400, False),
    ("folded header", req("GET /health HTTP/1.1", ["X-A: 1", "  continued"]), 400, False),
    ("bad header name", req("GET /health HTTP/1.1", ["X@Y: 1"]), 400, False),
    ("empty header name", req("GET /health HTTP/1.1", [": v"]), 400, False),
    ("nul in value", req("GET /health HTTP/1.1", [b"X-A: a\x00b"]), 400, False),
    ("long header", req("GET /health HTTP/1.1", ["X-Long: " + "v" * 9000]), 431, False),
    ("many headers", req("GET /health HTTP/1.1", [f"X-{i}: {i}" for i in range(200)]), 431, False),
    ("large head", req("GET /health HTTP/1.1", [f"X-{i}: " + "v" * 7000 for i in range(12)]), 431, False),
    (
        "unknown expectation",
        req("POST /v1/completions HTTP/1.1", ["Content-Length: 2", "Expect: magic"], b"{}"),
        417,
        False,
    ),
    # Content-Length
    *(
        (f"content-length {v!r}", req("POST /v1/completions HTTP/1.1", [b"Content-Length: " + v], b"{}"), 400, False)
        for v in (b"-1", b"1e3", b"12abc", b"0x10", b"+2", b"\xb2", b"", b"2, 2", b"1 2", b"\xd9\xa2")
    ),
    (
        "content-length huge",
        req("POST /v1/completions HTTP/1.1", ["Content-Length: 99999999999999999999999999"]),
        413,
        False,
    ),
    ("content-length 5000 digits", req("POST /v1/completions HTTP/1.1", ["Content-Length: " + "1" * 5000]), 413, False),
    (
        "content-length twice",
        req("POST /v1/completions HTTP/1.1", ["Content-Length: 2", "Content-Length: 3"], b"{}"),
        400,
        False,
    ),
    ("body shorter than length", req("POST /v1/completions HTTP/1.1", ["Content-Length: 100"], b"{}"), 400, True),
    (
        "chunked",  # read; no model named
        req("POST /v1/completions HTTP/1.1", ["Transfer-Encoding: chunked"], b"2\r\n{}\r\n0\r\n\r\n"),
        404,
        False,
    ),
    (
        "chunked and length",
        req("POST /v1/completions HTTP/1.1", ["Transfer-Encoding: chunked", "Content-Length: 2"], b"{}"),
        400,
        False,
    ),
    (
        "gzip transfer-encoding",
        req("POST /v1/completions HTTP/1.1", ["Transfer-Encoding: gzip"], b"{}"),
        501,
        False,
    ),
    (
        "chunk larger than the body limit",
        req("POST /v1/completions HTTP/1.1", ["Transfer-Encoding: chunked"], b"200000\r\n"),
        413,
        False,
    ),
    ("no length", req("POST /v1/completions HTTP/1.1"), 411, False),
    ("too large body", req("POST /v1/completions HTTP/1.1", [f"Content-Length: {1 << 21}"], b"x"), 413, False),
    # bodies
    ("nested arrays", post(b"[" * 100000 + b"]" * 100000), 400, False),
    ("nested objects", post(b'{"a":' * 50000 + b"1" + b"}" * 50000), 400, False),
    ("nested in prompt", post(b'{"model": "hybridpar", "prompt": ' + b"[" * 60000 + b"]" * 60000 + b"}"), 400, False),
    ("lone surrogate prompt", post(completion(prompt="\ud800")), 400, False),
    ("lone surrogate stop", post(completion(stop="\udfff")), 400, False),
    ("5000-digit integer", post(NUM + b"0" * 5000 + b"}"), 400, False),
    ("infinite temperature", post(NUM + b', "temperature": 1e999}'), 400, False),
    ("huge integer temperature", post(NUM + b', "temperature": 1' + b"0" * 400 + b"}"), 400, False),
    ("NaN top_p", post(NUM + b', "top_p": NaN}'), 400, False),
    ("invalid utf-8", post(b"\xff\xfe{}"), 400, False),
    ("utf-8 bom", post(b"\xef\xbb\xbf" + completion()), 400, False),
    ("null body", post(b"null"), 400, False),
    ("string body", post(b'"hi"'), 400, False),
    ("huge token id", post(completion(prompt=[10**30])), 400, False),
    ("float token ids", post(completion(prompt=[1.5, 2.0])), 400, False),
    ("negative max_tokens", post(completion(max_tokens=-3)), 400, False),
    ("model object", post(completion(model={"a": 1})), 404, False),
    ("unknown model", post(completion(model="gpt-9")), 404, False),
]


def test_enough_cases() -> None:
    assert len(CASES) >= 60 and len({name for name, *_ in CASES}) == len(CASES)


def assert_json_error(status: int | None, headers: dict[str, str], body: bytes, want: int | None, head: bool) -> None:
    assert status == want, (status, body[:300])
    if status is None:
        return
    assert 400 <= status <= 599 and status != 500
    assert headers.get("content-type") == "application/json", headers
    if head:  # a response to HEAD never has a body (RFC 9110 §9.3.2); the headers still say JSON
        assert body == b"" and int(headers["content-length"]) > 0
        return
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"], err
    if status == 405:
        assert headers.get("allow") in ("GET", "POST", "GET, POST"), headers


@pytest.mark.multiprocess
def test_malformed_requests_get_json_errors_and_health_stays_up(port: int) -> None:
    for name, raw, want, half in CASES:
        status, headers, body = exchange(port, raw, half)
        try:
            assert_json_error(status, headers, body, want, raw.startswith(b"HEAD "))
        except AssertionError as e:
            raise AssertionError(f"case {name!r}: {e}") from None
        status, _, body = exchange(port, req("GET /health HTTP/1.1"))
        assert status == 200 and json.loads(body)["status"] == "ok", (name, status, body)


@pytest.mark.multiprocess
def test_keep_alive_serves_several_requests_on_one_connection(port: int) -> None:
    """HTTP/1.1 keeps the connection after a complete answer, an error answer included when the request
    was well framed; a request pipelined behind another is answered after it."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(req("GET /nope HTTP/1.1") + req("GET /health HTTP/1.1") + post(completion(temperature=0)))
        data = b""
        while data.count(b"HTTP/1.1 ") < 3 or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    statuses = [int(part.split(b" ", 1)[0]) for part in data.split(b"HTTP/1.1 ")[1:]]
    assert statuses == [404, 200, 200], data
