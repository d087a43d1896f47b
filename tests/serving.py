"""What the live-server tests share: the tiny model every test server runs, its configuration (each test
overrides only what it is about) and a client call that returns the status and the decoded body."""

from __future__ import annotations

import http.client
import json
from contextlib import contextmanager
from typing import Any, Iterator

from hybridpar.config import ModelConfig
from hybridpar.serve.config import ServeConfig

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, ffn_dim=64)


def tiny_serve_config(**overrides: Any) -> ServeConfig:
    """A one-replica server of `MODEL` on an ephemeral loopback port, with timeouts long enough for
    loaded CI cores."""
    base: dict[str, Any] = {
        "source": "init:7",
        "served_model_name": "hybridpar",
        "port": 0,
        "max_seq_len": 64,
        "kv_tokens": 512,
        "timeout_s": 60,
        "request_timeout_s": 60,
    }
    return ServeConfig(**{**base, **overrides})


@contextmanager
def live_server(**overrides: Any) -> Iterator[tuple[int, Any]]:
    """Serve `MODEL` from a daemon thread (its replicas in worker processes) while the block runs;
    yields (port, service)."""
    from hybridpar.serve.http import serving_in_background
    from hybridpar.serve.service import Service

    cfg = tiny_serve_config(**overrides)
    svc = Service(cfg, MODEL, cfg.source)
    with serving_in_background(svc) as port:
        yield port, svc


def call(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60,
) -> tuple[int, Any]:
    """One request; a body that is not bytes is sent as JSON. Returns the status and the JSON answer
    (the text where the answer is not JSON)."""
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except json.JSONDecodeError:
        return resp.status, data.decode()
