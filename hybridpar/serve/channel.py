"""The channel between a replica's driver and the server that feeds it requests: a pipe carrying JSON bytes
(nothing is pickled)."""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from typing import Any


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
