"""Channels between a replica's driver and whoever feeds it requests: a list (tests, benchmarks in one
process) or a pipe carrying JSON bytes (the server; nothing is pickled)."""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from typing import Any


class ListChannel:
    """Serves `requests` at once, then a stop; collects every event."""

    def __init__(self, requests: list[dict[str, Any]]) -> None:
        self._todo = [*requests, {"type": "stop"}]
        self.events: list[dict[str, Any]] = []

    def recv(self, timeout_s: float) -> list[dict[str, Any]]:
        out, self._todo = self._todo, []
        return out

    def send(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def results(self) -> dict[str, list[int]]:
        return {e["id"]: e["tokens"] for e in self.events if e["type"] == "done"}


class PipeChannel:
    """One end of a multiprocessing pipe; messages are JSON documents sent as bytes."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def recv(self, timeout_s: float) -> list[dict[str, Any]]:
        out = []
        if self.conn.poll(timeout_s):
            while True:
                out.append(json.loads(self.conn.recv_bytes().decode()))
                if not self.conn.poll(0):
                    break
        return out

    def send(self, event: dict[str, Any]) -> None:
        self.conn.send_bytes(json.dumps(event).encode())
