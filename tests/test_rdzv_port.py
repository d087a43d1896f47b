"""A rendezvous endpoint whose port another program holds (an HTTP server, say) is named as such (no
processes). The agent's store client got a wrong reply to torch's handshake for read_timeout seconds and
then said the store "did not answer": start it with hybridpar rendezvous. It had answered, as something
else."""

from __future__ import annotations

import pytest

from hybridpar.topology import rdzv_client
from hybridpar.topology.rdzv_client import StoreLost, connect


def _refusing(reply: str):
    def store(*args: object, **kwargs: object) -> None:
        raise RuntimeError(reply)

    return store


def test_another_server_on_the_port_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.13's words, as the agent met `hybridpar serve` on the endpoint's port
    reply = "Ping failed, invalid value returned from server. Expected: 9524, Got: 1347703880"
    monkeypatch.setattr(rdzv_client.dist, "TCPStore", _refusing(reply))
    with pytest.raises(StoreLost, match=r"127\.0\.0\.1:8731 answers, but not as a rendezvous store"):
        connect("127.0.0.1", 8731, 1.0)


def test_a_silent_port_is_a_store_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rdzv_client.dist, "TCPStore", _refusing("Connection refused: timed out"))
    with pytest.raises(StoreLost, match="did not answer within 1 s .* hybridpar rendezvous --port 8731"):
        connect("127.0.0.1", 8731, 1.0)
