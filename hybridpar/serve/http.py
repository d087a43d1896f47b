"""OpenAI-compatible HTTP front end: POST /v1/completions and /v1/chat/completions (with `stream: true`
as server-sent events), GET /v1/models, /health and a Prometheus text /metrics, on the asyncio HTTP/1.1 server of
server.py. Every bad input is answered with a 4xx and an OpenAI-style error body naming the parameter;
overload is 429 (router queue full) or 503 (no replica alive, or a request past its deadline);
nothing a client sends can take the server down or get a 500.

Threads: the event loop runs every connection; the blocking steps (validating a body of up to 1 MiB,
placing a request, which writes to a replica's pipe) run on a pool of `WORKERS` threads; waiting for
a request's tokens takes none (the service's event queue wakes the loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Iterator, TypeVar

from hybridpar.serve.api import ApiError, parse_completion
from hybridpar.serve.chat import parse_chat
from hybridpar.serve.router import Overloaded, Unavailable
from hybridpar.serve.server import HttpServer
from hybridpar.serve.service import Pending, Service
from hybridpar.serve.text import NoText, StopText
from hybridpar.serve.wire import Request, Response, Stream, error_response

MAX_BODY = 1 << 20
WORKERS = 8
ROUTES = {
    "/health": ("GET",),
    "/v1/models": ("GET",),
    "/metrics": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
}
T = TypeVar("T")


def _json(status: int, obj: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(obj).encode(), headers=headers or {})


class Api:
    def __init__(self, svc: Service, pool: ThreadPoolExecutor) -> None:
        self.svc, self.pool, self.cfg = svc, pool, svc.cfg

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def __call__(self, req: Request) -> Response | Stream:
        try:
            if req.path == "*":  # OPTIONS * (the server's own options): none to offer
                raise ApiError(405, "OPTIONS is not supported", headers={"Allow": "GET, POST"})
            allowed = ROUTES.get(req.path)
            if allowed is None:
                raise ApiError(404, f"no route {req.method} {req.path[:200]}")
            if req.method not in allowed:
                raise ApiError(
                    405,
                    f"{req.method[:20]} is not allowed on {req.path}; use {', '.join(allowed)}",
                    headers={"Allow": ", ".join(allowed)},
                )
            if req.path.startswith("/v1/") and self.cfg.api_key and not self._authorized(req):
                raise ApiError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer KEY' (the server's --api-key)",
                    kind="invalid_request_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            if req.path == "/health":
                return _json(*self.svc.health())
            if req.path == "/v1/models":
                return _json(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "hybridpar"}],
                    },
                )
            if req.path == "/metrics":
                text = await self._run(self.svc.metrics.text)
                return Response(200, text, "text/plain; version=0.0.4; charset=utf-8")
            return await self._completions(req, chat=req.path == "/v1/chat/completions")
        except ApiError as e:
            if e.status in (429, 503):
                self.svc.counters["requests_rejected"] += 1
                e.headers.setdefault("Retry-After", "1")
            return error_response(e)
        except Exception as e:  # a bug of ours: answer 500, keep serving
            return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))

    def _authorized(self, req: Request) -> bool:
        # Digests compared in constant time: the time taken says nothing of how much of the key matched
        # (nor, hashed first, of its length).
        given = hashlib.sha256(req.headers.get("authorization", "").encode("latin-1")).digest()
        return hmac.compare_digest(given, hashlib.sha256(f"Bearer {self.cfg.api_key}".encode()).digest())

    async def _completions(self, req: Request, chat: bool) -> Response | Stream:
        if req.content_length is None and not req.chunked:
            raise ApiError(411, "a Content-Length header (or a chunked Transfer-Encoding) is required")
        name, svc = self.cfg.model_name, self.svc
        if chat:
            r = await self._run(parse_chat, req.body, name, self.cfg.request_tokens, svc.chat.render, svc.tokenize)
            r["stop_tokens"] = svc.chat_stop_tokens
        else:
            r = await self._run(
                parse_completion, req.body, name, self.cfg.request_tokens, svc.model.vocab_size, svc.tokenize
            )
        p = await self._run(self._submit, r)
        answer = Answer(p, name, chat, r.get("stop_tokens", []), r.get("include_usage", False))
        stop, events = StopText(r["stop"]), self._events(p)
        if not r["stream"]:
            try:
                return await self._complete(answer, stop, events)
            except asyncio.CancelledError:  # the client left (server.py): stop generating for nobody
                self._cancel_soon(p.id)
                raise
        try:  # the first token before the status line: failures keep theirs
            kind, val = await events.__anext__()
        except asyncio.CancelledError:
            self._cancel_soon(p.id)
            raise
        if kind == "done" and val.get("reason") == "error":
            raise ApiError(503, f"generation failed: {val.get('error')}", kind="server_error")
        return Stream({}, self._sse(answer, stop, events, kind, val), lambda: self._cancel_soon(p.id))

    def _cancel_soon(self, rid: str) -> None:
        """Tell the request's replica to stop generating it (the client is gone or out of time)."""
        try:
            self.pool.submit(self.svc.cancel, rid)
        except RuntimeError:
            pass  # the pool is shut down: the server is stopping, and its replicas with it

    def _submit(self, r: dict[str, Any]) -> Pending:
        if self.svc.alive() == 0:
            raise ApiError(503, "no replica is running", kind="server_error")
        try:
            return self.svc.submit(
                r["prompt"], r["max_tokens"], r["temperature"], r["top_p"], r["seed"], r.get("stop_tokens")
            )
        except Overloaded as e:
            raise ApiError(429, f"server overloaded: {e}; retry later", kind="rate_limit_error") from None
        except Unavailable as e:
            raise ApiError(503, str(e), kind="server_error") from None

    async def _events(self, p: Pending) -> AsyncIterator[tuple[str, Any]]:
        """('token', id) ... then ('done', info), or ApiError 503 at the request's deadline."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:  # runs in the thread that queued the event
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # the loop has stopped (server shut down): nobody waits any more

        p.events.listener = notify
        deadline = loop.time() + self.cfg.request_timeout_s
        while True:
            wake.clear()  # before looking: an event queued after the look sets it again
            try:
                kind, val = p.events.get_nowait()
            except queue.Empty:
                try:
                    await asyncio.wait_for(wake.wait(), deadline - loop.time())
                except asyncio.TimeoutError:
                    self._cancel_soon(p.id)
                    raise ApiError(
                        503, f"request not finished within {self.cfg.request_timeout_s:g} s", kind="server_error"
                    ) from None
                continue
            yield kind, val
            if kind == "done":
                return

    async def _stopped(self, p: Pending, n_tokens: int) -> dict[str, Any]:
        """A stop string matched: the replica is told to stop; the request ends here."""
        await self._run(self.svc.cancel, p.id, True)
        return {"reason": "stop", "completion_tokens": n_tokens}

    async def _complete(self, a: Answer, stop: StopText, events: AsyncIterator[tuple[str, Any]]) -> Response:
        det, text, n, ids = self.svc.detokenizer(), [], 0, []
        val: Any = {}
        async for kind, val in events:
            if kind == "token":
                n += 1
                ids.append(val)
                if val not in a.stop_tokens:  # the end-of-sequence token ends the text, it is none of it
                    text.append(stop.feed(det.feed(val)))
                if stop.hit:
                    val = await self._stopped(a.p, n)
                    break
        if val.get("reason") == "error":
            raise ApiError(503, f"generation failed: {val.get('error')}", kind="server_error")
        if not stop.hit:
            text += [stop.feed(det.flush()), stop.flush()]
        return _json(200, a.whole("".join(text), "stop" if stop.hit else val["reason"], val["completion_tokens"], ids))

    async def _sse(
        self, a: Answer, stop: StopText, events: AsyncIterator[tuple[str, Any]], kind: str, val: Any
    ) -> AsyncGenerator[bytes, None]:
        def data(obj: Any) -> bytes:
            return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"

        det = self.svc.detokenizer()
        ids_only = isinstance(det, NoText)  # no text to send: each chunk carries its token ids
        try:
            n, ids = 0, []
            while kind == "token":
                n += 1
                ids.append(val)
                piece = stop.feed(det.feed(val)) if val not in a.stop_tokens else ""
                if piece or (ids_only and val not in a.stop_tokens):
                    yield data(a.chunk(piece, ids=ids))
                    ids = []
                if stop.hit:
                    kind, val = "done", await self._stopped(a.p, n)
                    break
                kind, val = await events.__anext__()
            tail = "" if stop.hit else stop.feed(det.flush()) + stop.flush()
            finish = "stop" if stop.hit else val.get("reason")
            for last in a.last_chunks(tail, finish, val.get("completion_tokens"), ids):
                yield data(last)
        except ApiError as e:  # deadline passed mid-stream: the status is sent, so say it in the stream
            yield data(e.body())
        yield data(b"[DONE]")


class Answer:
    """The response bodies of one request, as OpenAI's API shapes them: a text completion
    (`text_completion`) or a chat completion (`chat.completion`, streamed as `chat.completion.chunk`
    deltas, the first carrying the role; usage in a last chunk of its own when stream_options asks)."""

    def __init__(self, p: Pending, model: str, chat: bool, stop_tokens: list[int], include_usage: bool) -> None:
        self.p, self.model, self.chat, self.stop_tokens, self.include_usage = p, model, chat, stop_tokens, include_usage
        self.started = False

    def _base(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.p.id,
            "object": kind,
            "created": int(self.p.created),
            "model": self.model,
            "choices": choices,
        }

    def _usage(self, n_out: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.p.prompt_tokens,
            "completion_tokens": n_out,
            "total_tokens": self.p.prompt_tokens + n_out,
        }

    def whole(self, text: str, finish: str, n_out: int, ids: list[int]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            out = self._base("chat.completion", [{**choice, "finish_reason": finish}])
        else:
            out = self._base("text_completion", [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}])
        # Beyond OpenAI's fields: the generated ids (all that a model without a tokenizer can answer).
        out["choices"][0]["token_ids"] = ids
        return {**out, "usage": self._usage(n_out)}

    def chunk(self, text: str, finish: str | None = None, ids: list[int] | None = None) -> dict[str, Any]:
        """A streamed chunk; `ids`: the generated token ids it covers (beyond OpenAI's fields, as `whole`
        has them: all that a model without a tokenizer can stream)."""
        extra = {} if ids is None else {"token_ids": list(ids)}
        if not self.chat:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish, **extra}
            return self._base("text_completion", [choice])
        delta = {"content": text} if text or finish is None else {}
        if not self.started:
            delta, self.started = {"role": "assistant", **delta}, True
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
        return self._base("chat.completion.chunk", [choice])

    def last_chunks(self, tail: str, finish: str | None, n_out: int | None, ids: list[int]) -> list[dict[str, Any]]:
        """The stream's end: the text held back and the finish reason, then (stream_options.include_usage)
        a chunk with no choices and the usage, as OpenAI's API sends it."""
        if self.chat:
            out = [self.chunk(tail, ids=ids)] if tail else []
            out.append(self.chunk("", finish, ids=None if tail else ids))
        else:
            out = [self.chunk(tail, finish, ids=ids)]
        if self.include_usage and n_out is not None:  # none after a failure
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            out.append({**self._base(kind, []), "usage": self._usage(n_out)})
        return out


def make_server(svc: Service, host: str, port: int) -> HttpServer:
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="hybridpar-http")
    return HttpServer(
        Api(svc, pool),
        host,
        port,
        svc.cfg.client_timeout_s,
        MAX_BODY,
        on_close=lambda: pool.shutdown(wait=False, cancel_futures=True),
    )


@contextmanager
def serving_in_background(svc: Service, host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """Answer for `svc` from a daemon thread while the block runs (tests, examples); yields the port.
    On exit the server stops, then the service (its workers)."""
    srv = make_server(svc, host, port)
    threading.Thread(target=srv.serve_forever, daemon=True, name="hybridpar-http-loop").start()
    try:
        yield srv.server_address[1]
    finally:
        try:
            srv.shutdown()
            srv.server_close()
        finally:
            svc.close()
