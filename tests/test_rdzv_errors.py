"""What an agent says when its rendezvous fails (no processes). An endpoint whose port another program
holds (an HTTP server, say): the store client got a wrong reply to torch's handshake for read_timeout
seconds and then said the store "did not answer": start it with hybridpar rendezvous. It had answered, as
something else. A job of --nnodes N that lost a node: the survivor waited join_timeout for it, and the
launcher's only line was "training failed (exit 1)"."""

from __future__ import annotations

import pytest

from hybridpar.topology import rdzv_client
from hybridpar.topology.rdzv_client import StoreLost, connect, store_error_line


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


def test_nodes_that_do_not_come_back_are_named() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    try:  # as torch's agent raises it: the rendezvous error inside its own
        try:
            raise RendezvousTimeoutError()
        except RendezvousTimeoutError as inner:
            raise RuntimeError("agent failed") from inner
    except RuntimeError as e:
        line = store_error_line(e, "127.0.0.1:29500")
    assert line is not None and "did not gather its nodes within --rdzv-conf join_timeout" in line
    assert "--nnodes MIN:MAX" in line and "--checkpoint.resume auto" in line
    lost = store_error_line(RendezvousConnectionError(), "n0:29500")  # unchanged: the store's host is gone
    assert lost is not None and "the rendezvous store at n0:29500 cannot be reached" in lost
    assert store_error_line(RendezvousConnectionError(), None) is None and store_error_line(ValueError(), "x") is None
