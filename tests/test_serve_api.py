"""The API beyond completions' bodies, against a stand-in pool (no processes): the served name, the API
key, token ids in streams, stream_options, chunked request bodies, and a client that leaves cancelling
its request in the replica, streamed or not."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import pytest

from hybridpar.config import ModelConfig
from hybridpar.serve.config import ServeConfig

HOLD = 0  # a prompt starting with this id "generates" nothing until cancelled


class Pool:
    """Stands in for the replica pool: echoes the prompt's ids as the generated tokens, except for a
    prompt starting with HOLD; records every message it is sent."""

    def __init__(self, spec: Any, on_event: Any) -> None:
        self.alive, self.on_event, self.failures, self.sent = [True] * spec.dp, on_event, [], []

    def send(self, rep: int, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        if msg["type"] == "generate" and msg["prompt"][0] != HOLD:
            out = (msg["prompt"] * msg["max_tokens"])[: msg["max_tokens"]]
            for t in out:
                self.on_event(rep, {"type": "token", "id": msg["id"], "token": t})
            self.on_event(rep, {"type": "done", "id": msg["id"], "reason": "length", "completion_tokens": len(out)})
        elif msg["type"] == "cancel":
            self.on_event(rep, {"type": "done", "id": msg["id"], "reason": "cancelled", "completion_tokens": 0})
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Any]:
    from hybridpar.serve.http import make_server
    from hybridpar.serve.service import Service

    started = []

    def start(**kw: Any) -> tuple[int, Any]:
        cfg = ServeConfig(source="runs/mine/", port=0, max_seq_len=256, **kw)
        svc = Service(cfg, ModelConfig(vocab_size=320), cfg.source, pool=Pool)
        srv = make_server(svc, "127.0.0.1", 0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return srv.server_address[1], svc

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


def request(port: int, raw: bytes, close_after_s: float | None = None) -> bytes:
    """Send raw bytes; the whole answer (read to the server's close), or b"" when we close first."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        if close_after_s is not None:
            time.sleep(close_after_s)
            return b""
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


def post(path: str, body: dict[str, Any], headers: tuple[str, ...] = ()) -> bytes:
    raw = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(raw)}", "Connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


def status_and_json(answer: bytes) -> tuple[int, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def sse(answer: bytes) -> list[dict[str, Any]]:
    events = [line[6:] for line in answer.partition(b"\r\n\r\n")[2].split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_served_name_is_the_source_and_streams_carry_token_ids(server: Any) -> None:
    assert ServeConfig(source="org/model").model_name == "org/model"
    assert ServeConfig(source="x", served_model_name="y").model_name == "y"
    port, _ = server()
    ids = [5, 300, 7]
    body = {"model": "runs/mine", "prompt": ids, "max_tokens": 5, "stream": True}
    chunks = sse(request(port, post("/v1/completions", body)))
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [5, 300, 7, 5, 300]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    opts = {**body, "stream_options": {"include_usage": True}}
    chunks = sse(request(port, post("/v1/completions", opts)))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    for bad in ({**body, "stream": False, "stream_options": {}}, {**body, "stream_options": {"continuous": True}}):
        status, err = status_and_json(request(port, post("/v1/completions", bad)))
        assert status == 400 and err["error"]["param"] == "stream_options", err
    status, err = status_and_json(request(port, post("/v1/completions", {**body, "model": "hybridpar"})))
    assert status == 404 and "'runs/mine'" in err["error"]["message"]


def test_api_key_is_required_on_v1_only(server: Any) -> None:
    port, _ = server(api_key="s3cret")
    body = {"model": "runs/mine", "prompt": [5], "max_tokens": 2}
    for headers in ((), ("Authorization: Bearer wrong",), ("Authorization: s3cret",)):
        answer = request(port, post("/v1/completions", body, headers))
        status, err = status_and_json(answer)
        assert status == 401 and err["error"]["code"] == "invalid_api_key" and b"WWW-Authenticate: Bearer" in answer
    status, out = status_and_json(request(port, post("/v1/completions", body, ("Authorization: Bearer s3cret",))))
    assert status == 200 and out["choices"][0]["token_ids"] == [5, 5]
    health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert status_and_json(request(port, health))[0] == 200
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret", max_retries=0, timeout=10)
    assert client.completions.create(model="runs/mine", prompt=[6], max_tokens=1).choices[0].finish_reason == "length"


def test_chunked_bodies_are_read(server: Any) -> None:
    port, _ = server()
    raw = json.dumps({"model": "runs/mine", "prompt": [9, 8], "max_tokens": 3}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(raw[i : i + 7]), raw[i : i + 7]) for i in range(0, len(raw), 7))
    status, out = status_and_json(request(port, head + chunks + b"0\r\nTrailer: x\r\n\r\n"))
    assert status == 200 and out["choices"][0]["token_ids"] == [9, 8, 9]
    status, err = status_and_json(request(port, head + b"zz\r\n"))
    assert status == 400 and "chunk size" in err["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_its_request(server: Any, stream: bool) -> None:
    port, svc = server()
    body = {"model": "runs/mine", "prompt": [HOLD, 1], "max_tokens": 4, "stream": stream}
    request(port, post("/v1/completions", body), close_after_s=0.2)
    deadline = time.monotonic() + 10
    while not any(m["type"] == "cancel" for m in svc.pool.sent) and time.monotonic() < deadline:
        time.sleep(0.02)
    gen = [m for m in svc.pool.sent if m["type"] == "generate"]
    assert [m["id"] for m in svc.pool.sent if m["type"] == "cancel"] == [gen[0]["id"]]
    assert svc.counters["requests_cancelled"] == 1 and not svc.inflight
