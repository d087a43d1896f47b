"""`hybridpar bench serve --scenario soak`: the HTTP server under `--clients` (200) concurrent clients, each
sending its share of `--requests` over its own connections (streamed and not, alternately), beside
`--slow-clients` (50) that trickle a request head a byte at a time, all on loopback.

Measured: every answer well-formed (200, JSON or server-sent events ending in [DONE], as many token ids
as asked for), the slow clients turned away (408 or closed at `--client-timeout-s`), `/health` probed
throughout (status and latency), the server's process tree RSS sampled (bounded: its growth over the
run), and `/metrics` read back by `prometheus_client.parser`: each latency histogram's count must equal
the requests sent.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import select
import socket
import threading
import time
from typing import Any

from hybridpar.bench.serve_throughput import MODEL, serve_config


def _answer_ok(resp: http.client.HTTPResponse, n: int, stream: bool) -> bool:
    data = resp.read()
    if resp.status != 200:
        return False
    if not stream:
        body = json.loads(data)
        return len(body["choices"][0]["token_ids"]) == n == body["usage"]["completion_tokens"]
    events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
    ids = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]] if events else []
    return bool(events) and events[-1] == b"[DONE]" and len(ids) == n


def _client(port: int, seed: int, n: int, tally: dict[str, int], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    for j in range(n):
        k, stream = rng.randint(4, 8), j % 2 == 1
        body = {"model": "soak", "prompt": [rng.randrange(256) for _ in range(rng.randint(8, 48))], "max_tokens": k}
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}))
            ok = _answer_ok(conn.getresponse(), k, stream)
            conn.close()
        except (OSError, ValueError, KeyError, http.client.HTTPException):
            ok = False
        with lock:
            tally["ok" if ok else "bad"] += 1


def _slow(port: int, until: float, tally: dict[str, int], lock: threading.Lock) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" * 4
    got, sent = b"", 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            while sent < len(head) and time.monotonic() < until:
                if select.select([s], [], [], 0.2)[0]:  # the server answered or closed: turned away
                    break
                s.sendall(head[sent : sent + 1])
                sent += 1
            got = s.recv(100)
        except OSError:
            pass  # reset by the server: turned away
    with lock:
        tally["slow_408" if got.startswith(b"HTTP/1.1 408") else "slow_closed" if not got else "slow_other"] += 1


def soak(a: Any) -> dict[str, Any]:
    import psutil
    from prometheus_client.parser import text_string_to_metric_families

    from hybridpar.serve.http import serving_in_background
    from hybridpar.serve.service import Service

    base = serve_config(1, 1)
    cfg = dataclasses.replace(base, served_model_name="soak", max_groups=4, client_timeout_s=a.client_timeout_s)
    per = max(1, a.requests // a.clients)
    tally = {"ok": 0, "bad": 0, "slow_408": 0, "slow_closed": 0, "slow_other": 0}
    lock, health, rss, me = threading.Lock(), [], [], psutil.Process()
    with serving_in_background(Service(cfg, MODEL, cfg.source)) as port:
        _client(port, -1, 4, {"ok": 0, "bad": 0}, lock)  # warm-up (not counted by the client, by /metrics yes)

        def tree_rss() -> int:
            return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])

        rss_start, t0 = tree_rss(), time.perf_counter()
        threads = [threading.Thread(target=_client, args=(port, i, per, tally, lock)) for i in range(a.clients)]
        until = time.monotonic() + 60
        threads += [threading.Thread(target=_slow, args=(port, until, tally, lock)) for _ in range(a.slow_clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            t1 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/health")
            health.append((conn.getresponse().status, time.perf_counter() - t1))
            conn.close()
            rss.append(tree_rss())
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    counts = {
        s.name.removeprefix("hybridpar:"): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.endswith("_seconds_count")
    }
    sent = per * a.clients + 4  # the warm-up's 4 included
    lat = sorted(x for _, x in health)
    return {
        "clients": a.clients,
        "requests_per_client": per,
        "slow_clients": a.slow_clients,
        "requests_sent": sent,
        **tally,
        "wall_s": wall,
        "health_probes": len(health),
        "health_non_200": sum(s != 200 for s, _ in health),
        "health_p50_s": lat[len(lat) // 2] if lat else None,
        "health_max_s": lat[-1] if lat else None,
        "rss_start_mb": rss_start / 2**20,
        "rss_max_mb": max(rss, default=rss_start) / 2**20,
        "histogram_counts": counts,
        # Inter-token latency counts tokens, not requests: every other histogram counts each request once.
        "histogram_counts_equal_requests_sent": all(v == sent for k, v in counts.items() if "inter_token" not in k),
    }
