"""OpenAI-compatible HTTP front end (stdlib `http.server`, one thread per connection):
POST /v1/completions (with `stream: true` as server-sent events), GET /v1/models, /health and a
Prometheus text /metrics. Every bad input is answered with a 4xx and an OpenAI-style error body
naming the parameter; overload is 429 (router queue full) or 503 (no replica alive, or a request
past its deadline); nothing a client sends can take the server down.
"""

from __future__ import annotations

import json
import math
import queue
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hybridpar.serve.router import Overloaded, Unavailable
from hybridpar.serve.service import Service
from hybridpar.serve.text import ByteDetokenizer, StopText

MAX_BODY = 1 << 20
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's API takes up to 4 stop sequences


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


def parse_completion(raw: bytes, model_name: str, max_seq_len: int, vocab_size: int,
                     tokenize: Any) -> dict[str, Any]:
    """Validate a /v1/completions body; returns the request as the service takes it, or raises ApiError."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if body.get("model") != model_name:
        raise ApiError(404, f"model {body.get('model')!r} does not exist; this server serves {model_name!r}",
                       "model", code="model_not_found")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # the client wraps a single string in a list
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
    elif not (isinstance(prompt, str) and prompt):
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                       "prompt")
    ids = tokenize(prompt)
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    if len(ids) + max_tokens > max_seq_len:
        raise ApiError(400, f"prompt of {len(ids)} tokens + max_tokens={max_tokens} exceeds this model's "
                            f"maximum of {max_seq_len} tokens", "prompt", code="context_length_exceeded")
    for key, allowed in (("n", (None, 1)), ("best_of", (None, 1)), ("echo", (None, False)), ("logprobs", (None,)),
                         ("suffix", (None,))):
        if body.get(key) not in allowed:
            raise ApiError(400, f"{key}={body.get(key)!r} is not supported by this server", key)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ApiError(400, f"seed must be a non-negative integer, got {seed!r}", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS
            and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop)):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings, each 1 to "
                            f"{MAX_STOP_CHARS} characters, got {body.get('stop')!r}", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", "stream")
    return {"prompt": ids, "max_tokens": max_tokens, "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 1e-6, 1.0), "seed": seed, "stream": stream, "stop": stop}


def metrics_text(stats: dict[str, Any]) -> str:
    """Prometheus exposition format of the service's measured counters and router state."""
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float | None]]) -> None:
        lines.extend([f"# HELP hybridpar_{name} {help_}", f"# TYPE hybridpar_{name} {kind}"])
        lines.extend(f"hybridpar_{name}{labels} {v}" for labels, v in samples if v is not None)

    c = stats["counters"]
    for key, help_ in (("requests_total", "requests accepted"), ("requests_completed", "requests finished"),
                       ("requests_failed", "requests failed"),
                       ("requests_retried", "requests started over on another replica after theirs died"),
                       ("requests_cancelled", "requests given up by their client (timed out) before the end"),
                       ("prompt_tokens_total", "prompt tokens processed"), ("completion_tokens_total", "tokens generated"),
                       ("requests_rejected", "requests refused (429/503)")):
        metric(key if key.endswith("total") else key + "_total", "counter", help_, [("", c.get(key, 0))])
    metric("pending_requests", "gauge", "requests waiting in the router", [("", stats["pending"])])
    metric("replicas_alive", "gauge", "replicas running", [("", stats["replicas_alive"])])
    lat = stats["latency_s"]
    metric("request_latency_seconds", "gauge", "request latency percentiles over the recent window",
           [(f'{{quantile="{q}"}}', lat[k]) for q, k in (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99"))])
    per = stats["replicas"]
    for key, help_ in (("queue_depth", "requests waiting for a KV slot"), ("outstanding_requests", "requests placed"),
                       ("kv_used_tokens", "KV-cache slots allocated"), ("utilisation", "measured busy fraction"),
                       ("decode_s_per_token", "measured decode seconds per token (EWMA)"),
                       ("prefill_s_per_token", "measured prefill seconds per prompt token (EWMA)")):
        metric(f"replica_{key}", "gauge", help_, [(f'{{replica="{i}"}}', r[key]) for i, r in enumerate(per)])
    metric("strategy_decisions_total", "counter", "placements by strategy",
           [(f'{{strategy="{k}"}}', v) for k, v in sorted(stats["strategy_usage"].items())])
    return "\n".join(lines) + "\n"


def make_handler(svc: Service) -> type[BaseHTTPRequestHandler]:
    cfg = svc.cfg

    class Handler(BaseHTTPRequestHandler):
        server_version = "hybridpar"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: /metrics has the numbers
            pass

        def _json(self, status: int, obj: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: ApiError) -> None:
            if e.status in (429, 503):
                svc.counters["requests_rejected"] += 1
            self._json(e.status, e.body(), {"Retry-After": "1"} if e.status in (429, 503) else None)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/health":
                ok = svc.alive() == cfg.dp
                self._json(200 if ok else 503, {"status": "ok" if ok else "degraded",
                                                "replicas_alive": svc.alive(), "replicas": cfg.dp})
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": cfg.model_name, "object": "model",
                                                             "created": 0, "owned_by": "hybridpar"}]})
            elif path == "/metrics":
                data = metrics_text(svc.statistics()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._error(ApiError(404, f"no route GET {path}"))

        def do_POST(self) -> None:
            try:
                if self.path.split("?")[0] != "/v1/completions":
                    raise ApiError(404, f"no route POST {self.path}")
                n = self.headers.get("Content-Length")
                if n is None or not n.isdigit():
                    raise ApiError(411, "a Content-Length header is required")
                if int(n) > MAX_BODY:
                    raise ApiError(413, f"request body of {n} bytes exceeds {MAX_BODY}")
                req = parse_completion(self.rfile.read(int(n)), cfg.model_name, cfg.max_seq_len,
                                       svc.model.vocab_size, svc.tokenize)
                if svc.alive() == 0:
                    raise ApiError(503, "no replica is running", kind="server_error")
                try:
                    p = svc.submit(req["prompt"], req["max_tokens"], req["temperature"], req["top_p"], req["seed"])
                except Overloaded as e:
                    raise ApiError(429, f"server overloaded: {e}; retry later", kind="rate_limit_error") from None
                except Unavailable as e:
                    raise ApiError(503, str(e), kind="server_error") from None
                (self._stream if req["stream"] else self._complete)(p, StopText(req["stop"]))
            except ApiError as e:
                self._error(e)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left
            except Exception as e:  # a bug of ours: answer 500, keep serving
                self._json(500, ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").body())

        def _events(self, p: Any):  # yields ('token', id) ... then ('done', info)
            deadline = time.monotonic() + cfg.request_timeout_s
            while True:
                try:
                    kind, val = p.events.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    svc.cancel(p.id)
                    raise ApiError(503, f"request not finished within {cfg.request_timeout_s} s", kind="server_error") from None
                yield kind, val
                if kind == "done":
                    return

        def _response(self, p: Any, text: str, finish: str | None, n_out: int | None) -> dict[str, Any]:
            out = {"id": p.id, "object": "text_completion", "created": int(p.created), "model": cfg.model_name,
                   "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            if n_out is not None:
                out["usage"] = {"prompt_tokens": p.prompt_tokens, "completion_tokens": n_out,
                                "total_tokens": p.prompt_tokens + n_out}
            return out

        def _stopped(self, p: Any, n_tokens: int) -> dict[str, Any]:
            """A stop string matched: the replica is told to stop; the request ends here."""
            svc.cancel(p.id, completed=True)
            return {"reason": "stop", "completion_tokens": n_tokens}

        def _complete(self, p: Any, stop: StopText) -> None:
            det, text, n = ByteDetokenizer(), [], 0
            for kind, val in self._events(p):
                if kind == "token":
                    n += 1
                    text.append(stop.feed(det.feed(val)))
                    if stop.hit:
                        val = self._stopped(p, n)
                        break
            if val.get("reason") == "error":
                raise ApiError(503, f"generation failed: {val.get('error')}", kind="server_error")
            if not stop.hit:
                text += [stop.feed(det.flush()), stop.flush()]
            self._json(200, self._response(p, "".join(text), "stop" if stop.hit else val["reason"],
                                           val["completion_tokens"]))

        def _stream(self, p: Any, stop: StopText) -> None:
            events = self._events(p)
            kind, val = next(events)  # wait for the first token so that failures still get a status code
            if kind == "done" and val.get("reason") == "error":
                raise ApiError(503, f"generation failed: {val.get('error')}", kind="server_error")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            det = ByteDetokenizer()

            def send(obj: Any) -> None:
                self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
                self.wfile.flush()

            try:
                n = 0
                while kind == "token":
                    n += 1
                    if piece := stop.feed(det.feed(val)):
                        send(self._response(p, piece, None, None))
                    if stop.hit:
                        kind, val = "done", self._stopped(p, n)
                        break
                    kind, val = next(events)
                tail = "" if stop.hit else stop.feed(det.flush()) + stop.flush()
                send(self._response(p, tail, "stop" if stop.hit else val.get("reason"), val.get("completion_tokens")))
            except ApiError as e:  # deadline passed mid-stream: the status is sent, so say it in the stream
                send(e.body())
            send(b"[DONE]")
            self.close_connection = True

    return Handler


def make_server(svc: Service, host: str, port: int) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer((host, port), make_handler(svc))
    srv.daemon_threads = True
    return srv
