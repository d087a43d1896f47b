"""The HTTP server: each bad input gets the right 4xx with a message naming the parameter, overload
gets 429, and the official `openai` client completes and streams the tokens the model generates."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from typing import Any, Iterator

import pytest

from hybridpar.data.corpus import decode
from hybridpar.model.registry import build_full_model
from hybridpar.model.stage import generate
from hybridpar.serve.config import ServeConfig
from hybridpar.serve.http import make_server
from hybridpar.serve.router import Overloaded
from tests.serving import MODEL, call, live_server, tiny_serve_config


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, Any]]:
    with live_server() as (port, svc):
        yield port, svc


def post(port: int, obj: Any) -> tuple[int, Any]:
    return call(port, "POST", "/v1/completions", json.dumps(obj).encode(), {"Content-Type": "application/json"})


GOOD = {"model": "hybridpar", "prompt": "def ", "max_tokens": 4, "temperature": 0}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "body,status,param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({**GOOD, "model": "gpt-9"}, 404, "model"),
        ({**GOOD, "prompt": "x" * 70}, 400, "prompt"),  # 70 + 4 > max_seq_len = 64
        ({**GOOD, "prompt": ""}, 400, "prompt"),
        ({**GOOD, "prompt": [1, 2, 999]}, 400, "prompt"),  # token id outside the vocabulary
        ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
        ({**GOOD, "temperature": -1}, 400, "temperature"),
        ({**GOOD, "temperature": "hot"}, 400, "temperature"),
        ({**GOOD, "top_p": 0}, 400, "top_p"),
        ({**GOOD, "top_p": 1.5}, 400, "top_p"),
        ({**GOOD, "n": 3}, 400, "n"),
        ({**GOOD, "seed": -2}, 400, "seed"),
        ({**GOOD, "stream": "yes"}, 400, "stream"),
        ({**GOOD, "stop": ""}, 400, "stop"),
        ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),  # at most 4
        ({**GOOD, "stop": [3]}, 400, "stop"),
    ],
)
def test_bad_requests_get_4xx(server: tuple[int, Any], body: Any, status: int, param: str | None) -> None:
    port, _ = server
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, resp = call(port, "POST", "/v1/completions", raw)
    assert got == status, resp
    assert resp["error"]["param"] == param and resp["error"]["message"]


@pytest.mark.multiprocess
def test_routes_and_headers(server: tuple[int, Any]) -> None:
    port, _ = server
    assert call(port, "GET", "/nope")[0] == 404
    assert call(port, "POST", "/v1/chat")[0] == 404
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # no Content-Length
    conn.putrequest("POST", "/v1/completions")
    conn.endheaders()
    assert conn.getresponse().status == 411
    assert call(port, "POST", "/v1/completions", b"x", {"Content-Length": str(1 << 21)})[0] == 413
    status, health = call(port, "GET", "/health")
    assert status == 200 and health["replicas_alive"] == 1
    assert call(port, "GET", "/v1/models")[1]["data"][0]["id"] == "hybridpar"


@pytest.mark.multiprocess
def test_openai_client_completes_and_streams(server: tuple[int, Any]) -> None:
    openai = pytest.importorskip("openai")
    port, _ = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)
    want = decode(generate(build_full_model(MODEL, 7), list(b"def "), 8, temperature=0))
    out = client.completions.create(model="hybridpar", prompt="def ", max_tokens=8, temperature=0)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 8)
    chunks = list(client.completions.create(model="hybridpar", prompt="def ", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "length"
    a, b = (
        client.completions.create(model="hybridpar", prompt="def ", max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
        .choices[0]
        .text
        for _ in range(2)
    )
    assert a == b  # seeded sampling repeats
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    status, text = call(port, "GET", "/metrics")
    assert status == 200 and 'hybridpar:requests_completed_total{model_name="hybridpar"}' in text
    assert 'hybridpar:time_to_first_token_seconds_count{model_name="hybridpar"}' in text and 'replica="0"' in text


@pytest.mark.multiprocess
def test_stop_strings_cut_the_text_and_stop_the_replica(server: tuple[int, Any]) -> None:
    openai = pytest.importorskip("openai")
    port, svc = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)
    want = decode(generate(build_full_model(MODEL, 7), list(b"def "), 16, temperature=0))
    # A stop string from the middle of what greedy decoding gives (not a replacement character).
    at = next(i for i in range(2, len(want) - 1) if "\ufffd" not in want[i : i + 2])
    stop = want[at : at + 2]
    cut = want[: want.find(stop)]
    for stream in (False, True):
        out = client.completions.create(
            model="hybridpar",
            prompt="def ",
            max_tokens=16,
            temperature=0,
            stop=[stop, "never-generated"],
            stream=stream,
        )
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == cut, (stream, want, stop)
        assert chunks[-1].choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 10
    while svc.router.where and time.monotonic() < deadline:  # the replica's "cancelled" frees the place
        time.sleep(0.05)
    assert not svc.router.where and not svc.inflight
    out = client.completions.create(model="hybridpar", prompt="def ", max_tokens=16, temperature=0, stop="@@@@")
    assert out.choices[0].text == want and out.choices[0].finish_reason == "length"


def test_cancel_tells_the_replica_frees_the_place_and_counts_it() -> None:
    from hybridpar.serve.service import Service

    class Pool(_Pool):
        def send(self, d: int, msg: dict[str, Any]) -> bool:
            if msg["type"] == "cancel":
                self.sent.append((d, "cancel " + msg["id"]))
                return True
            return super().send(d, msg)

    cfg = ServeConfig(source="init:7", dp=1, max_outstanding=1)
    svc = Service(cfg, MODEL, cfg.source, pool=Pool)
    a, b, c = (svc.submit([1, 2], 4, 0.0, 1.0, None) for _ in range(3))  # a runs, b and c wait
    svc.cancel(b.id)  # b's client timed out while it waited: nothing to tell a replica
    svc.cancel(a.id)  # a's timed out while running: its replica is told
    assert svc.pool.sent == [(0, a.id), (0, "cancel " + a.id)]
    svc._on_event(0, {"type": "done", "id": a.id, "reason": "cancelled"})
    assert svc.pool.sent[2:] == [(0, c.id)]  # b's turn came and went: c runs
    svc.cancel(c.id, completed=True)  # a stop string matched
    svc._on_event(0, {"type": "done", "id": c.id, "reason": "cancelled"})
    assert a.events.empty() and b.events.empty() and c.events.empty() and not svc.router.where
    assert (
        svc.counters["requests_cancelled"],
        svc.counters["requests_completed"],
        svc.counters["requests_failed"],
    ) == (2, 1, 0)


def test_a_cancelled_request_whose_replica_dies_before_its_done_is_not_counted_failed() -> None:
    from hybridpar.serve.service import Service

    cfg = ServeConfig(source="init:7", dp=3, strategy="round_robin")
    svc = Service(cfg, MODEL, cfg.source, pool=_Pool)
    a, b = svc.submit([1, 2], 4, 0.0, 1.0, None), svc.submit([3], 4, 0.0, 1.0, None)  # a on 0, b on 1
    svc.cancel(a.id, completed=True)  # a stop string matched
    svc.cancel(b.id)  # b's client timed out
    for rep in (0, 1):  # each replica dies before its "cancelled" done comes back
        svc.pool.alive[rep] = False
        svc._on_event(rep, {"type": "replica_failed"})
    assert a.events.empty() and b.events.empty() and not svc.router.where and not svc._cancelled
    assert (
        svc.counters["requests_completed"],
        svc.counters["requests_cancelled"],
        svc.counters["requests_failed"],
    ) == (1, 1, 0)


def test_stop_text_holds_back_what_may_become_a_stop() -> None:
    from hybridpar.serve.text import StopText

    s = StopText(["abc", "xy"])
    assert [s.feed(p) for p in ("12a", "b", "d", "ab", "c", "zzz")] == ["12", "", "abd", "", "", ""]
    assert s.hit and s.flush() == ""
    s = StopText(["abc", "xy"])
    assert s.feed("1x") == "1" and s.feed("2") == "x2" and s.feed("ab") == "" and s.flush() == "ab"
    s = StopText(["cd", "b"])  # the earliest match wins, whichever string it is
    assert s.feed("abcd") == "a" and s.hit
    assert StopText([]).feed("anything") == "anything"
    with pytest.raises(ValueError, match="non-empty"):
        StopText([""])


class _Full:
    """A service whose router refuses everything (as `Router.submit` does when full)."""

    def __init__(self) -> None:
        self.cfg = ServeConfig(served_model_name="m")
        self.model = MODEL
        self.counters: Counter = Counter()

    def alive(self) -> int:
        return 1

    def tokenize(self, prompt: Any) -> list[int]:
        return list(prompt.encode()) if isinstance(prompt, str) else prompt

    def submit(self, *args: Any) -> None:
        raise Overloaded("all 1 replicas are at max_outstanding=32 and 64 requests are waiting")


def test_overload_is_429_with_retry_after() -> None:
    svc = _Full()
    srv = make_server(svc, "127.0.0.1", 0)  # type: ignore[arg-type]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({**GOOD, "model": "m"}))
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 429 and resp.getheader("Retry-After") == "1"
        assert "overloaded" in body["error"]["message"]
    finally:
        srv.shutdown()
        srv.server_close()


class _Pool:
    """Stands in for ReplicaPool: records what each replica is sent; a dead replica's send fails."""

    def __init__(self, spec: Any, on_event: Any) -> None:
        self.alive = [True] * spec.dp
        self.sent: list[tuple[int, str]] = []

    def send(self, d: int, msg: dict[str, Any]) -> bool:
        if self.alive[d]:
            self.sent.append((d, msg["id"]))
        return self.alive[d]


def test_a_request_past_the_kv_budget_is_refused_up_front_not_failed_by_its_replica() -> None:
    svc = _Full()
    svc.cfg = ServeConfig(served_model_name="m", kv_tokens=72, block_size=16)  # 4 blocks: 64 tokens (max_seq_len 1024)
    srv = make_server(svc, "127.0.0.1", 0)  # type: ignore[arg-type]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({**GOOD, "model": "m", "prompt": "x" * 61}))
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
        # A replica would answer it with an error done (a 503, as if the server had failed): never sent to one.
        assert (resp.status, err["param"]) == (400, "prompt") and "maximum of 64 tokens" in err["message"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_dead_replica_requests_are_placed_again_or_failed_clearly() -> None:
    from hybridpar.serve.router import Unavailable
    from hybridpar.serve.service import Service

    cfg = ServeConfig(source="init:7", dp=2, strategy="round_robin", max_outstanding=1)
    svc = Service(cfg, MODEL, cfg.source, pool=_Pool)
    pool = svc.pool
    a, b, c, d = (svc.submit([1, 2], 4, 0.0, 1.0, None) for _ in range(4))  # a on 0, b on 1, c and d wait
    assert pool.sent == [(0, a.id), (1, b.id)]
    pool.alive[1] = False  # replica 1's pipe broke; its reader has not reported it yet
    svc._on_event(1, {"type": "done", "id": b.id, "reason": "length"})  # c is placed on 1: its send fails
    svc._on_event(1, {"type": "replica_failed"})
    assert c.events.empty() and svc.router.statistics()["pending"] == 2  # c waits again, ahead of d
    svc._on_event(0, {"type": "done", "id": a.id, "reason": "length"})
    assert pool.sent[2:] == [(0, c.id)]  # c runs on the live replica
    svc._on_event(0, {"type": "token", "id": c.id, "token": 5})  # c's client now holds a token
    pool.alive[0] = False
    svc._on_event(0, {"type": "replica_failed"})  # c (half-streamed) and d have nowhere to go: they fail
    assert [p.events.get_nowait()[1]["reason"] for p in (a, b)] == ["length", "length"]
    assert c.events.get_nowait() == ("token", 5)
    assert c.events.get_nowait()[1] == {
        "reason": "error",
        "error": "no replica is running (the last one, replica 0, stopped)",
    }
    assert "no replica is running" in d.events.get_nowait()[1]["error"]
    with pytest.raises(Unavailable):
        svc.submit([1], 4, 0.0, 1.0, None)
    assert svc.counters["requests_failed"] == 2 and not svc.inflight


def test_a_half_streamed_request_resumes_on_a_live_replica_from_what_was_sent() -> None:
    from hybridpar.serve.service import Service

    cfg = ServeConfig(source="init:7", dp=3, strategy="round_robin")
    svc = Service(cfg, MODEL, cfg.source, pool=_Pool)
    pool = svc.pool
    msgs: list[dict] = []
    send = pool.send
    pool.send = lambda d, m: msgs.append(m) or send(d, m)  # type: ignore[method-assign]
    a, b = svc.submit([1, 2], 5, 0.7, 1.0, 40), svc.submit([3], 2, 0.0, 1.0, None)  # a on 0, b on 1
    for t in (7, 8):
        svc._on_event(0, {"type": "token", "id": a.id, "token": t})
    svc._on_event(1, {"type": "token", "id": b.id, "token": 4})
    svc._on_event(1, {"type": "token", "id": b.id, "token": 5})  # b has all its tokens, no done yet
    pool.alive[0] = False
    svc._on_event(0, {"type": "replica_failed"})
    svc._on_event(0, {"type": "token", "id": a.id, "token": 9})  # late from the dead replica: not streamed
    assert msgs[-1] == {**a.msg, "prompt": [1, 2, 7, 8], "max_tokens": 3, "seed": 42} and pool.sent[-1] == (2, a.id)
    assert svc.counters["requests_resumed"] == 1 and [a.events.get_nowait() for _ in range(2)] == [
        ("token", 7),
        ("token", 8),
    ]
    for t in (9, 10, 11):
        svc._on_event(2, {"type": "token", "id": a.id, "token": t})
    svc._on_event(2, {"type": "done", "id": a.id, "reason": "length", "prompt_tokens": 4, "completion_tokens": 3})
    got = [a.events.get_nowait() for _ in range(4)]
    assert got[:3] == [("token", 9), ("token", 10), ("token", 11)] and a.events.empty()
    assert (got[3][1]["prompt_tokens"], got[3][1]["completion_tokens"]) == (2, 5)  # counts of the whole request
    pool.alive[1] = False  # b's replica dies after b's last token, before its done
    svc._on_event(1, {"type": "replica_failed"})
    assert [b.events.get_nowait()[0] for _ in range(3)] == ["token", "token", "done"]  # done without a resend
    assert svc.counters["requests_failed"] == 0 and not svc.inflight


def test_a_request_that_streamed_its_stop_token_is_done_not_resumed_past_it() -> None:
    from hybridpar.serve.service import Service

    cfg = ServeConfig(source="init:7", dp=2, strategy="round_robin")
    svc = Service(cfg, MODEL, cfg.source, pool=_Pool)
    pool = svc.pool
    a = svc.submit([1, 2], 6, 0.0, 1.0, None, stop_tokens=[5])  # on replica 0, 5 tokens still owed after its stop
    svc._on_event(0, {"type": "token", "id": a.id, "token": 5})  # its stop token; the replica dies before its done
    pool.alive[0] = False
    svc._on_event(0, {"type": "replica_failed"})
    assert pool.sent == [(0, a.id)]  # not sent again: a resumed request would generate past its stop
    assert a.events.get_nowait() == ("token", 5)
    kind, done = a.events.get_nowait()
    assert (kind, done["reason"], done["completion_tokens"]) == ("done", "stop", 1)
    assert svc.counters["requests_completed"] == 1 and not svc.inflight


def test_a_sent_request_whose_client_saw_nothing_starts_over_on_a_live_replica() -> None:
    from hybridpar.serve.service import Service

    cfg = ServeConfig(source="init:7", dp=2, strategy="round_robin", max_outstanding=1)
    svc = Service(cfg, MODEL, cfg.source, pool=_Pool)
    pool = svc.pool
    a, b, c = (svc.submit([1, 2], 4, 0.0, 1.0, 3) for _ in range(3))  # a on 0, b on 1, c waits
    svc._on_event(1, {"type": "token", "id": b.id, "token": 9})  # b is half-streamed
    pool.alive[0] = False
    svc._on_event(0, {"type": "replica_failed"})  # a was sent to 0 but streamed nothing: it waits again
    assert a.events.empty() and svc.counters["requests_retried"] == 1
    svc._on_event(0, {"type": "token", "id": a.id, "token": 7})  # late from the dead replica: dropped
    assert a.events.empty()
    svc._on_event(1, {"type": "done", "id": b.id, "reason": "length"})
    assert pool.sent[-1] == (1, a.id)  # a starts over on replica 1, ahead of c (same message, seed kept)
    svc._on_event(1, {"type": "token", "id": a.id, "token": 8})
    svc._on_event(0, {"type": "done", "id": a.id, "reason": "length"})  # the dead replica's: ignored
    assert a.events.get_nowait() == ("token", 8) and a.events.empty()
    svc._on_event(1, {"type": "done", "id": a.id, "reason": "length"})
    assert a.events.get_nowait()[1]["reason"] == "length" and pool.sent[-1] == (1, c.id)
    assert svc.counters["requests_failed"] == 0 and svc.counters["requests_completed"] == 2


@pytest.mark.multiprocess
def test_a_full_live_server_refuses_with_429_then_serves_again() -> None:
    # One replica that takes one request and queues one more: a burst of long requests fills it.
    with live_server(max_outstanding=1, max_pending=1) as (port, svc):
        _burst_until_refused(port, svc)


def _burst_until_refused(port: int, svc: Any) -> None:
    long = {**GOOD, "max_tokens": 60}
    results: list[tuple[int, str | None, Any]] = []

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        results.append((resp.status, resp.getheader("Retry-After"), json.loads(resp.read())))
        conn.close()

    for _ in range(3):  # a burst normally fills it at once; retried in case the replica outpaced it
        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if any(s != 200 for s, _, _ in results):
            break
    refused = [(s, ra, body) for s, ra, body in results if s != 200]
    assert refused, "the server never refused a request"
    for s, ra, body in refused:
        assert s in (429, 503) and ra == "1" and body["error"]["message"], (s, body)
    done = [body for s, _, body in results if s == 200]
    assert done and all(b["usage"]["completion_tokens"] == 60 for b in done)  # accepted ones finish whole
    status, body = post(port, GOOD)  # and it serves again
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert svc.counters["requests_rejected"] == len(refused) and svc.counters["requests_failed"] == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_killed_replica_request_completes_on_the_live_one() -> None:
    from hybridpar.serve.service import Service

    # Replica 0 is emulated 200x slow: a request there has streamed its first token, not its last, when
    # the process is killed. It must resume on replica 1 from prompt + that token and end with the
    # greedy tokens of an uninterrupted run (replica 1's own, the same model).
    cfg = tiny_serve_config(dp=2, strategy="round_robin", emulate_slowdown="0:200")
    svc = Service(cfg, MODEL, cfg.source)
    try:

        def tokens(p, n: int | None = None) -> tuple[list[int], dict]:
            out = []
            while n is None or len(out) < n:
                kind, v = p.events.get(timeout=60)
                if kind == "done":
                    return out, v
                out.append(v)
            return out, {}

        a = svc.submit([1, 2, 3], 12, 0.0, 1.0, None)  # round robin: replica 0
        assert svc.router.where[a.id] == 0 and a.sent
        head, _ = tokens(a, 1)
        svc.pool.procs[0].kill()
        rest, info = tokens(a)
        assert info["reason"] == "length" and info["completion_tokens"] == 12 and len(head + rest) == 12
        ref, _ = tokens(svc.submit([1, 2, 3], 12, 0.0, 1.0, None))  # replica 1, the only one alive
        assert head + rest == ref and svc.counters["requests_failed"] == 0
        assert svc.counters["requests_resumed"] == 1 and svc.counters["requests_retried"] == 0
        assert [(f["replica"], f["rank"]) for f in svc.pool.failures] == [(0, 0)]  # the killed driver, named
    finally:
        svc.close()
