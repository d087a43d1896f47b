"""The HTTP server, on one asyncio event loop.

Why not `http.server`: it spends a thread on every connection, waits for a request head forever,
listens with a backlog of 5 and answers malformed requests with HTML pages. Here:
- a connection is a coroutine, not a thread: idle and slow clients cost a socket each;
- a request's head must arrive within `client_timeout_s` of the connection (or of the previous answer
  on a kept-alive one), and its body within as long again; a connection on which no request began by
  then is closed silently (a kept-alive client may be just about to reuse it), a later one gets 408;
- every error, a broken request line included, is the API's JSON error body (`{"error": {...}}`,
  wire.py reads requests strictly);
- the listen backlog is the system's maximum (at least 1024), so bursts of connections queue;
- while a request is being answered the connection is watched: a client that closes it (or its sending
  side) has its answer cancelled, and with it the request's generation (http.py cancels on
  CancelledError), streamed or not, instead of generating for nobody.
The application (`App`) runs on the loop; its blocking work goes to a thread pool of its own.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Awaitable, Callable, TypeVar

from hybridpar.serve.api import ApiError
from hybridpar.serve.wire import (
    MAX_LINE,
    App,
    Progress,
    Response,
    Stream,
    error_response,
    format_head,
    read_body,
    read_chunked,
    read_request,
)

T = TypeVar("T")
LINGER_S = 2.0
BACKLOG = max(1024, socket.SOMAXCONN)


class HttpServer:
    """`serve_forever()` answers on (host, port) until `shutdown()` (from another thread) or an
    exception such as KeyboardInterrupt; `server_close()` releases the socket. The socket is bound
    at construction, so a port in use fails at once and `server_address` is known."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        client_timeout_s: float,
        max_body: int,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self.app, self.client_timeout_s, self.max_body, self._on_close = app, client_timeout_s, max_body, on_close
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self.server_address = self._sock.getsockname()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running = self._stop_requested = False
        self._done = threading.Event()
        self._tasks: dict[asyncio.Task, asyncio.StreamWriter] = {}  # open connections

    def serve_forever(self) -> None:
        self._running = True
        try:
            asyncio.run(self._main())
        finally:
            self._done.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_requested:  # shutdown() came before the loop was up
            return
        # The backlog again: asyncio listens anew on a socket it is given (with 100 by default).
        server = await asyncio.start_server(self._connection, sock=self._sock, limit=MAX_LINE, backlog=BACKLOG)
        try:
            await self._stop.wait()
        finally:
            server.close()
            # Closing each connection as well as cancelling its task: asyncio.wait_for (3.11) can lose a
            # cancellation that races with its result (cpython gh-86296); a closed connection ends anyway.
            for t, w in list(self._tasks.items()):
                w.close()
                t.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=5)

    def shutdown(self) -> None:
        """Stop serve_forever (call from another thread) and wait until it has returned."""
        self._stop_requested = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop has already ended
        if self._running:
            self._done.wait(30)

    def server_close(self) -> None:
        self._sock.close()
        self._on_close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks[task] = writer
        carry = bytearray()  # a byte of the next request, read while watching the current one
        try:
            while await self._exchange(reader, writer, carry):
                pass
        except (OSError, asyncio.TimeoutError):
            pass  # the client left (or its socket failed), or it stopped reading its answer
        except asyncio.CancelledError:
            # The server is stopping. Ending quietly, not as cancelled: asyncio's streams (3.11) log
            # a cancelled connection task as an error.
            pass
        finally:
            self._tasks.pop(task, None)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, carry: bytearray) -> bool:
        """Serve one request; True to keep the connection for the next."""
        progress, t = Progress(), self.client_timeout_s
        try:
            try:
                first = bytes(carry)
                carry.clear()
                req = await asyncio.wait_for(read_request(reader, writer, progress, self.max_body, first), t)
                if req is None:
                    return False
                n = req.content_length or 0
                req.body = await asyncio.wait_for(
                    read_chunked(reader, self.max_body) if req.chunked else read_body(reader, n), t
                )
            except asyncio.TimeoutError:
                if not progress.started:
                    return False  # idle: close without a word
                raise ApiError(408, f"the request did not arrive within {t:g} s") from None
        except ApiError as e:  # malformed, too large or too slow: answer, then close (the framing is lost)
            await self._send(writer, error_response(e), False, False)
            await self._linger(reader, writer)
            return False
        watch = asyncio.ensure_future(reader.read(1))
        try:
            resp = await self._unless_gone(self.app(req), watch)
            if resp is None:
                return False
            if isinstance(resp, Stream):
                await self._unless_gone(self._stream(writer, resp), watch)
                return False
        finally:
            if watch.done() and not watch.cancelled() and watch.exception() is None:
                carry += watch.result()  # pipelined: the next request's first byte
            watch.cancel()  # a read waiting for data loses nothing when cancelled
        await self._send(writer, resp, req.keep_alive, req.method == "HEAD")
        return req.keep_alive

    @staticmethod
    async def _unless_gone(work: Awaitable[T], watch: asyncio.Future) -> T | None:
        """`work`'s result, or None (with `work` cancelled) if the client closes its side first. A byte
        arriving instead (a pipelined request) ends the watch: `work` then runs to its end."""
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done and (watch.exception() is not None or watch.result() == b""):
                task.cancel()
                await asyncio.wait({task})
                return None
            return await task
        except BaseException:
            task.cancel()  # the server stops (or the watch failed): the work stops with it
            raise

    async def _send(self, writer: asyncio.StreamWriter, resp: Response, keep: bool, head_only: bool) -> None:
        headers = {
            "Content-Type": resp.content_type,
            "Content-Length": str(len(resp.body)),
            "Connection": "keep-alive" if keep else "close",
            **resp.headers,
        }
        # A response to HEAD carries the headers of the one to GET, never its body (RFC 9110 §9.3.2).
        writer.write(format_head(resp.status, headers) + (b"" if head_only else resp.body))
        await asyncio.wait_for(writer.drain(), self.client_timeout_s)

    async def _stream(self, writer: asyncio.StreamWriter, resp: Stream) -> None:
        finished = False
        try:
            writer.write(
                format_head(
                    200,
                    {
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "Connection": "close",
                        **resp.headers,
                    },
                )
            )
            async for chunk in resp.chunks:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), self.client_timeout_s)
            finished = True
        finally:
            if not finished:
                resp.abort()
            await resp.chunks.aclose()

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Close after an error without losing the answer: closing with unread input makes the kernel
        reset the connection, which can discard our answer before the client reads it. So: end our
        side (FIN), read and drop what the client still sends for a moment, then close."""

        async def drain() -> None:
            while await reader.read(65536):
                pass

        try:
            if writer.can_write_eof():
                writer.write_eof()
            await asyncio.wait_for(drain(), LINGER_S)
        except (OSError, asyncio.TimeoutError):
            pass
