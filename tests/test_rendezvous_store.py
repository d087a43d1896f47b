"""The standalone rendezvous store (`hybridpar rendezvous`, topology/rdzv_store.py) and the agents' side of it
(topology/rdzv_client.py), without starting a process: argument parsing and its errors, the line an agent
prints about where the store lives, and, in this process over loopback sockets, a client that outlives a
restart of the store and an agent's rendezvous that is written back into the restarted store. The runs of
two agents that lose a node, the store, or both: tests/test_node_loss.py."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from hybridpar.cli import main
from hybridpar.topology.rdzv_client import ReconnectingStore, StoreLost, store_error_line, store_lost
from hybridpar.topology.rdzv_store import STANDALONE_KEY, host_store, parse_rendezvous_args
from hybridpar.topology.rendezvous import ATTEMPT_ENV, _create_handler, store_note


def test_arguments() -> None:
    assert parse_rendezvous_args([]) == ("127.0.0.1", 29400)  # loopback unless told otherwise
    assert parse_rendezvous_args(["--port", "0", "--host", "0.0.0.0"]) == ("0.0.0.0", 0)
    assert parse_rendezvous_args(["--port=5000"]) == ("127.0.0.1", 5000)
    for argv, why in (
        (["--port", "x"], "--port expects a non-negative integer, got 'x'"),
        (["--port", "-1"], "--port expects a non-negative integer, got '-1'"),
        (["--port", "70000"], "--port 70000 is not a TCP port (0 to 65535)"),
        (["--prot", "5"], "unknown option --prot; did you mean --port?"),
        (["5000"], "unrecognized arguments: 5000"),
    ):
        with pytest.raises(ValueError) as e:
            parse_rendezvous_args(argv)
        assert str(e.value) == why, argv


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rendezvous", "--help"]) == 0
    assert "Restart:" in capsys.readouterr().out
    assert main(["rendezvous", "--port", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridpar rendezvous: error: --port expects a non-negative integer, got 'x'\n")
    assert main(["rendezvus"]) == 2 and "rendezvous" in capsys.readouterr().err  # listed among the commands


def test_where_the_store_lives() -> None:
    warn = store_note(1, 2, False, "node0:29500")
    assert warn.startswith("hybridpar: warning: the rendezvous store at node0:29500 lives inside a training agent")
    assert "hybridpar rendezvous --host ADDR --port 29500" in warn and "is_host=false" in warn and "\n" not in warn
    assert store_note(2, 2, False, "node0:29500") is None  # static: losing any node ends the job anyway
    assert store_note(1, 1, False, "127.0.0.1:0") is None  # one node
    assert "--port 29400" in store_note(1, 4, False, "node0")  # torch's default port
    assert "--port 7" in store_note(1, 4, False, "[::1]:7") and "--port 29400" in store_note(1, 4, False, "[::1]")
    assert store_note(1, 2, True, "store:29400") == (
        "hybridpar: rendezvous store: the standalone store at store:29400 (no training node hosts it)"
    )


def test_a_lost_store_is_named_behind_torchs_errors() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def wrapped(cause: BaseException) -> BaseException:  # as torch's c10d backend raises it
        try:
            try:
                raise cause
            except BaseException as e:
                raise RendezvousConnectionError("The connection to the C10d store has failed.") from e
        except RendezvousConnectionError as outer:
            return outer

    lost = StoreLost("the rendezvous store at h:1 stopped answering")
    assert store_lost(wrapped(lost)) is lost and store_lost(ValueError("other")) is None
    assert store_error_line(wrapped(lost), "h:1") == "hybridpar: error: the rendezvous store at h:1 stopped answering"
    died = store_error_line(wrapped(RuntimeError("Broken pipe")), "node0:29500")  # its host agent is gone
    assert died.startswith("hybridpar: error: the rendezvous store at node0:29500 cannot be reached: if a training")
    assert "hybridpar rendezvous --help" in died and "\n" not in died
    assert store_error_line(RuntimeError("a worker failed"), "node0:29500") is None
    assert store_error_line(wrapped(RuntimeError("x")), None) is None  # one node: its own store


def test_a_client_outlives_a_restart_of_the_store() -> None:
    server = host_store("127.0.0.1", 0)
    port = server.port
    client = ReconnectingStore("127.0.0.1", port, timeout_s=10)
    seen: list[int] = []
    client.on_reconnect.append(lambda inner: seen.append(inner.add("hooked", 1)))
    client.set("a", "1")
    del server  # the store stops; its state goes with it
    server = host_store("127.0.0.1", port)
    assert client.add("n", 2) == 2 and client.get("hooked") == b"1" and seen == [1] and client.generation == 1
    assert not client.check(["a"])  # what the old store held is gone
    pfx = dist.PrefixStore("round", client)  # as torch's rendezvous uses it: timeouts pass through
    pfx.set_timeout(timedelta(seconds=1))
    assert client.timeout == timedelta(seconds=1)
    del server
    with pytest.raises(StoreLost, match="stopped answering and did not come back within 1 s"):
        pfx.get("x")
    with pytest.raises(StoreLost):  # once lost, at once (the agent ends; no second wait)
        client.set("b", "1")


def _params(port: int, run_id: str = "r"):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    conf = {"last_call_timeout": 1, "keep_alive_interval": 60, "read_timeout": 10}
    return RendezvousParameters("hybridpar-loopback", f"127.0.0.1:{port}", run_id, 1, 2, **conf)


def test_the_rendezvous_is_written_back_into_a_restarted_store(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An agent of a formed round, its store restarted empty: its next sync writes the round back, so a
    node that comes next waits for the round to admit it instead of forming one of its own."""
    monkeypatch.setenv(ATTEMPT_ENV, "")
    server = host_store("127.0.0.1", 0)
    port = server.port
    server.set(STANDALONE_KEY, "1")
    agent = _create_handler(_params(port), loopback=True)
    assert capsys.readouterr().err == (
        f"hybridpar: rendezvous store: the standalone store at 127.0.0.1:{port} (no training node hosts it)\n"
    )
    info = agent.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    round_ = agent._state_holder.state.round
    del server
    server = host_store("127.0.0.1", port)
    server.set(STANDALONE_KEY, "1")
    agent._state_holder._last_sync_time = -1  # past torch's 1 s cache of the state
    assert agent.num_nodes_waiting() == 0  # syncs: reconnects, finds the store empty, writes the round back
    err = capsys.readouterr().err
    assert "restarted: reconnected" in err and f"(round {round_}, 1 nodes)" in err
    newcomer = _create_handler(_params(port), loopback=True)._state_holder
    newcomer.sync()
    assert newcomer.state.round == round_ and newcomer.state.complete and len(newcomer.state.participants) == 1
    agent.shutdown()


def test_an_agent_hosting_the_store_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a free port, released for the agent to bind
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = _create_handler(_params(port), loopback=True)
    assert capsys.readouterr().err.startswith(
        f"hybridpar: warning: the rendezvous store at 127.0.0.1:{port} lives inside a training agent"
    )
    assert not isinstance(agent._store, ReconnectingStore)
