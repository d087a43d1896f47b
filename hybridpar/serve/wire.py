"""HTTP/1.1 messages on asyncio streams: reading a request strictly, formatting a response.

Strict because a client's bytes are untrusted: every malformed request line, header or length is an
ApiError with the status HTTP gives it (the server answers it as the API's JSON error body), never an
exception of another kind. Limits, as common servers set them: request line 8 KiB (414); a header line
8 KiB, 100 headers, 64 KiB in all (431); a body at most `max_body` (413), framed by Content-Length or
by chunked Transfer-Encoding (RFC 9112 §7.1; both at once is refused, as a request-smuggling risk).
Timeouts are the caller's (server.py).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import AsyncGenerator, Awaitable, Callable

from hybridpar.serve.api import ApiError

MAX_LINE = 8192
MAX_HEADERS = 100
MAX_HEAD = 65536
MAX_BLANK_LINES = 4  # RFC 9112 §2.2: empty lines before a request line are to be ignored (a few)
TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 §5.6.2
VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
TARGET = re.compile(r"[\x21-\x7e]+")  # visible ASCII (RFC 3986 characters, percent-encoded or not)
VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")  # field content: no control characters (RFC 9110 §5.5)
DIGITS = re.compile(r"[0-9]+")


@dataclass
class Request:
    method: str
    path: str  # the target without its query
    version: str
    headers: dict[str, str]  # names lower-cased
    body: bytes = b""
    content_length: int | None = None
    keep_alive: bool = False
    chunked: bool = False  # the body comes in chunks (Transfer-Encoding: chunked), its length unknown


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Stream:
    """A response of unknown length (server-sent events): status 200 and `headers` now, then each chunk
    as `chunks` yields it, then the connection closes. `abort` is called if it ends early (the client
    left, or the server stops)."""

    headers: dict[str, str]
    chunks: AsyncGenerator[bytes, None]
    abort: Callable[[], None]


App = Callable[[Request], Awaitable["Response | Stream"]]


def error_response(e: ApiError) -> Response:
    return Response(e.status, json.dumps(e.body()).encode(), headers=e.headers)


def _clip(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def format_head(status: int, headers: dict[str, str]) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    lines = [f"HTTP/1.1 {status} {reason}", "Server: hybridpar", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _line(reader: asyncio.StreamReader, what: str, too_long: int) -> bytes:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise ApiError(too_long, f"{what} longer than {MAX_LINE} bytes") from None
    except asyncio.IncompleteReadError:
        raise ApiError(400, f"the connection ended inside the {what}") from None


def _parse_request_line(raw: bytes) -> tuple[str, str, str]:
    text = raw.decode("latin-1").removesuffix("\n").removesuffix("\r")
    parts = text.split(" ")
    if len(parts) != 3:
        raise ApiError(400, f"malformed request line {_clip(text)}: want METHOD TARGET HTTP/1.1, one space apart")
    method, target, version = parts
    if not VERSION.fullmatch(version):
        raise ApiError(400, f"malformed HTTP version {_clip(version)} in the request line")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise ApiError(505, f"{version} is not supported: this server speaks HTTP/1.1 (and 1.0)")
    if not TOKEN.fullmatch(method):
        raise ApiError(400, f"malformed method {_clip(method)}")
    if not TARGET.fullmatch(target):
        raise ApiError(400, f"request target {_clip(target)} has characters outside visible ASCII")
    if target.startswith("/"):
        path = target.split("?", 1)[0]
    elif target.startswith(("http://", "https://")):  # absolute form (RFC 9112 §3.2.2): its path counts
        path = "/" + target.split("://", 1)[1].partition("/")[2].split("?", 1)[0]
    elif target == "*" and method == "OPTIONS":
        path = "*"
    else:
        raise ApiError(400, f"request target {_clip(target)} must be a path starting with /")
    return method, path, version


def _parse_header(raw: bytes, headers: dict[str, str]) -> None:
    text = raw.decode("latin-1").removesuffix("\n").removesuffix("\r")
    if text[:1] in (" ", "\t"):
        raise ApiError(400, "a header line starts with whitespace (obsolete line folding is not accepted)")
    name, colon, value = text.partition(":")
    if not colon or not TOKEN.fullmatch(name):
        raise ApiError(400, f"malformed header line {_clip(text)}: want Name: value")
    value = value.strip(" \t")
    if not VALUE.fullmatch(value):
        raise ApiError(400, f"header {name} has control characters in its value")
    key = name.lower()
    if key in headers:
        if key in ("content-length", "host"):
            raise ApiError(400, f"more than one {name} header")
        value = headers[key] + ", " + value
    headers[key] = value


def _content_length(headers: dict[str, str], max_body: int) -> int | None:
    if (te := headers.get("transfer-encoding")) is not None:
        if te.strip().lower() != "chunked":  # gzip and the like: no client of this API sends them
            raise ApiError(501, f"Transfer-Encoding {_clip(te)} is not supported (only chunked)")
        if "content-length" in headers:
            raise ApiError(400, "a request with both Transfer-Encoding and Content-Length is refused: send one")
        return None
    v = headers.get("content-length")
    if v is None:
        return None
    if not DIGITS.fullmatch(v):
        raise ApiError(400, f"Content-Length {_clip(v)} is not a non-negative integer")
    if len(v) > 18 or int(v) > max_body:  # (a length check first: int() refuses over 4300 digits)
        raise ApiError(413, f"request body of {v if len(v) <= 18 else 'more than 10**18'} bytes exceeds {max_body}")
    return int(v)


class Progress:
    """Whether a byte of the next request has arrived (a timeout then is a 408, not an idle close)."""

    started = False


async def read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, progress: Progress, max_body: int, first: bytes = b""
) -> Request | None:
    """The next request's head; None if the client closed before sending one. `first`: its first byte,
    when the caller has read it already (while watching for the client leaving)."""
    first = first or await reader.read(1)
    if not first:
        return None
    progress.started = True
    for _ in range(MAX_BLANK_LINES + 1):
        raw = first if first == b"\n" else first + await _line(reader, "request line", 414)
        if raw.strip(b"\r\n"):
            break
        if not (first := await reader.read(1)):
            return None
    else:
        raise ApiError(400, f"no request line after {MAX_BLANK_LINES} empty lines")
    method, path, version = _parse_request_line(raw)
    headers: dict[str, str] = {}
    size = len(raw)
    while (line := await _line(reader, "header line", 431)) not in (b"\r\n", b"\n"):
        size += len(line)
        if size > MAX_HEAD or len(headers) >= MAX_HEADERS:
            raise ApiError(431, f"request head larger than {MAX_HEAD} bytes or {MAX_HEADERS} headers")
        _parse_header(line, headers)
    n = _content_length(headers, max_body)
    if (expect := headers.get("expect")) is not None:
        if expect.lower() != "100-continue":
            raise ApiError(417, f"Expect: {_clip(expect)} is not supported (only 100-continue)")
        if version == "HTTP/1.1" and (n or "transfer-encoding" in headers):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
    return Request(method, path, version, headers, b"", n, keep, "transfer-encoding" in headers)


async def read_body(reader: asyncio.StreamReader, n: int) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise ApiError(400, f"the connection ended after {len(e.partial)} of the {n} body bytes") from None


async def read_chunked(reader: asyncio.StreamReader, max_body: int) -> bytes:
    """A chunked body (RFC 9112 §7.1): hex size lines (extensions ignored), each chunk and its CRLF, a zero
    size, then trailer lines (dropped) up to an empty line. At most `max_body` bytes in all (413)."""
    body = bytearray()
    while True:
        line = (await _line(reader, "chunk size line", 400)).rstrip(b"\r\n")
        size = line.split(b";", 1)[0].strip()
        if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size):
            raise ApiError(400, f"malformed chunk size line {_clip(line.decode('latin-1'))}")
        n = int(size, 16)
        if n == 0:
            break
        if len(body) + n > max_body:
            raise ApiError(413, f"chunked request body exceeds {max_body} bytes")
        body += await read_body(reader, n)
        if await read_body(reader, 2) != b"\r\n":
            raise ApiError(400, "a chunk does not end with CRLF where its size says")
    for _ in range(MAX_HEADERS + 1):  # trailer fields: read and dropped
        if (await _line(reader, "trailer line", 431)) in (b"\r\n", b"\n"):
            return bytes(body)
    raise ApiError(431, f"more than {MAX_HEADERS} trailer lines")
