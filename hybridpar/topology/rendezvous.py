"""torchrun's c10d rendezvous, three times adapted: listening on loopback only, agreeing on one attempt id
per rendezvous round, and a client of a store outside the training nodes.

Loopback: torch's TCPStore server listens on every interface, and torchrun's c10d rendezvous creates two
of them (the rendezvous store and the store shared with the workers). For runs on one machine (one agent,
or several agents standing in for nodes) we bind the listening socket ourselves to 127.0.0.1 and hand it
to TCPStore (`master_listen_fd`); the first agent to bind the endpoint's port hosts the store, the others
connect to it. Nothing is reachable from the network unless the user passes an endpoint of their own.

Attempt id: the workers of one rendezvous round share the agent's worker store, which outlives the
round, so each round's process group keys need a prefix of their own (topology/mesh.py). torch's
TORCHELASTIC_RESTART_COUNT is counted per agent: after a node is lost and another joins, the survivor's
workers are at restart 1 and the newcomer's at 0, and they would never meet. So the agents agree on a
random id per round through the round's own store (rank 0 of the round writes it, every agent reads it)
and hand it to their workers in `ATTEMPT_ENV`. For the same reason a worker asks `job_restarts`, not its
agent's count, whether the job started before (and so resumes): the newcomer's workers, at restart 0,
would start the run afresh while the survivors' resume, and the two halves would wait for each other's
collectives until the timeout. `hybridpar train` uses these handlers for `--rdzv-backend
c10d` (loopback for a loopback endpoint); plain torchrun reaches them as `--rdzv-backend
hybridpar-loopback` or `hybridpar-c10d` (entry points, see pyproject.toml).

Store outside the nodes: whichever agent hosts the rendezvous store takes the job down with its node.
When `hybridpar rendezvous` (topology/rdzv_store.py) hosts it instead, the agents see the key it writes,
reconnect when it restarts and write the rendezvous back into it (topology/rdzv_client.py); an agent of
an elastic job whose store lives in an agent warns (`store_note`). `--rdzv-conf is_host=false` makes an
agent a client only (torch's own key, honoured here for loopback endpoints too).
"""

from __future__ import annotations

import errno
import os
import secrets
import sys

import torch.distributed as dist

from hybridpar.topology.rdzv_client import ReconnectingStore, connect, restore_rendezvous
from hybridpar.topology.rdzv_store import DEFAULT_PORT, STANDALONE_KEY, host_store

LOOPBACK_BACKEND = "hybridpar-loopback"
C10D_BACKEND = "hybridpar-c10d"
ATTEMPT_ENV = "HYBRIDPAR_RDZV_ATTEMPT"  # plumbing from agent to workers, like torch's own TORCHELASTIC_*
ROUND_ENV = "HYBRIDPAR_RDZV_ROUND"  # the rendezvous round, the same on every node of it
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def loopback_store(port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server bound to 127.0.0.1:port (0 picks a free port; see `.port`)."""
    return host_store("127.0.0.1", port, timeout_s)


def set_loopback_rank_env(rank: int, world: int, port: int) -> None:
    """This process's environment as rank `rank` of `world` local ranks joining the store its caller hosts
    on loopback `port` (every rank a client, rank 0 included): the spawn helper's ranks and the serving
    pool's workers."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )


def host_or_join_loopback(port: int, timeout_s: float, is_host: bool | None = None) -> dist.TCPStore:
    """The rendezvous store on 127.0.0.1:port: hosted here if the port is free, else (another agent on this
    machine, or `hybridpar rendezvous`, hosts it) a client of it. `is_host` (torch's --rdzv-conf key):
    True hosts or fails, False connects only (waiting up to `timeout_s` for the store to listen)."""
    if is_host is not False:
        try:
            return loopback_store(port, timeout_s)
        except OSError as e:
            if is_host or port == 0 or e.errno != errno.EADDRINUSE:
                raise
    return connect("127.0.0.1", port, timeout_s)


def store_note(min_nodes: int, max_nodes: int, standalone: bool, endpoint: str) -> str | None:
    """The line an agent prints about where the rendezvous store lives, or None: a warning where the
    job is elastic (a lost node is meant to be survived) but the store lives inside a training agent,
    whose node the job then cannot lose."""
    if standalone:
        return f"hybridpar: rendezvous store: the standalone store at {endpoint} (no training node hosts it)"
    if max_nodes <= min_nodes:
        return None
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)[1]
    return (
        f"hybridpar: warning: the rendezvous store at {endpoint} lives inside a training agent, so losing "
        f"that agent's node ends the job (--nnodes {min_nodes}:{max_nodes} survives any other node); run it "
        f"outside the training nodes (hybridpar rendezvous --host ADDR --port {port}) and give every agent "
        "--rdzv-conf is_host=false"
    )


def _each_round(handler, next_rendezvous):  # wraps DynamicRendezvousHandler.next_rendezvous
    def wrapped():
        # torch caches where the workers' store is (MASTER_ADDR/PORT) from the first round and rebuilds it
        # only for a node that becomes rank 0; a node that was rank 0 and is no longer (a node joined
        # and sorts first) would send its workers to its own old store. Rebuild it every round.
        handler._bootstrap_store_info = None
        info = next_rendezvous()
        # The round's store is a PrefixStore of this round only: a key written here is never stale.
        if info.rank == 0:
            info.store.set("hybridpar/attempt", secrets.token_hex(6))
        # The agent starts its workers next; they inherit its environment. torch numbers the rounds in the
        # rendezvous state every node shares (a new round once every node of the last one has left it).
        os.environ[ATTEMPT_ENV] = info.store.get("hybridpar/attempt").decode()
        os.environ[ROUND_ENV] = str(handler._state_holder.state.round)
        return info

    return wrapped


def _create_handler(params, loopback: bool):  # -> RendezvousHandler
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    name = LOOPBACK_BACKEND if loopback else C10D_BACKEND

    class _Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # reported in torch's rendezvous events as --rdzv-backend
            return name

    timeout_s = float(params.get_as_int("read_timeout", 60))
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    if loopback:
        store = host_or_join_loopback(port, timeout_s, params.get_as_bool("is_host"))
    else:
        store = create_backend(params)[1]  # torch's own choice of host and client (is_host, else hostname)
    standalone = store.check([STANDALONE_KEY])  # written by `hybridpar rendezvous` as it starts
    if standalone:
        store = ReconnectingStore(host, port, timeout_s, inner=store)
    backend = _Backend(store, params.run_id)
    handler = create_handler(store, backend, params)
    if standalone:
        restore_rendezvous(handler, backend, store)
    if loopback:
        # The handler also starts the store the workers share (MASTER_ADDR/PORT); bind that one to
        # loopback too. `_create_tcp_store_server` is the (private) hook torch uses for it.
        handler._create_tcp_store_server = lambda addr, port: loopback_store(port)
    handler.next_rendezvous = _each_round(handler, handler.next_rendezvous)
    if note := store_note(params.min_nodes, params.max_nodes, standalone, params.endpoint):
        print(note, file=sys.stderr, flush=True)
    return handler


def _create_loopback_handler(params):
    return _create_handler(params, loopback=True)


def _create_c10d_handler(params):
    return _create_handler(params, loopback=False)


def register_loopback_rendezvous() -> None:
    """Make `--rdzv-backend hybridpar-loopback` and `hybridpar-c10d` available to torch.distributed.run in
    this process."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    for name, create in ((LOOPBACK_BACKEND, _create_loopback_handler), (C10D_BACKEND, _create_c10d_handler)):
        try:
            rendezvous_handler_registry.register(name, create)
        except ValueError:
            pass  # already registered in this process


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a rendezvous endpoint (host[:port], [v6]:port) names this machine's loopback interface."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(endpoint, default_port=0)[0] in LOOPBACK_HOSTS


def worker_store_prefix() -> str:
    """The prefix of this worker's process-group keys in the agent's store: the attempt id its agents
    agreed on for this rendezvous round, or (a handler that does not agree on one, e.g. torch's own c10d)
    the agent's restart count, which is the same on every node until nodes leave and join."""
    return f"/hybridpar/attempt_{os.environ.get(ATTEMPT_ENV) or os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def job_restarts() -> int:
    """How many times the job's workers started before these, as every node sees it: the rendezvous round
    (0 for the job's first) where these handlers ran the rendezvous, else (torch's own backends, one
    agent) the agent's TORCHELASTIC_RESTART_COUNT. A node that joins a running job is at restart 0 of
    its own agent but not of the job: it must resume with the survivors (resilience/elastic.py)."""
    own = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return max(own, int(os.environ.get(ROUND_ENV, "0")))


def torchrun_handler():  # entry point "torchrun.handlers": plain `torchrun --rdzv-backend hybridpar-loopback`
    return _create_loopback_handler


def torchrun_c10d_handler():  # entry point "torchrun.handlers": plain `torchrun --rdzv-backend hybridpar-c10d`
    return _create_c10d_handler
