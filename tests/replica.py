"""What the serving tests that drive a replica without a server share: a channel that serves a list of
requests at once (the server's is a pipe, serve/channel.py) and the topology of a one-device replica run in
the test's own process."""

from __future__ import annotations

from typing import Any

import torch

from hybridpar.topology.mesh import ParallelDims, Topology


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


def local_topology(device: torch.device | str = "cpu", timeout_s: float = 120.0) -> Topology:
    """The layout of a single-device replica run inside this process (no process group needed)."""
    return Topology(ParallelDims(1, 1, 1, 1), 0, None, torch.device(device), "none", timeout_s)  # type: ignore[arg-type]
