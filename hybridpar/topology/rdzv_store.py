"""`hybridpar rendezvous`: the rendezvous store as a process of its own, outside the training nodes, so that
no training node is a single point of failure.

torch's c10d rendezvous keeps its state (who takes part, the round, heartbeats) in a TCPStore that the
first agent hosts; when that agent's node dies the store dies with it and every other agent fails
("Connection closed"), whichever node was lost. This process hosts the same kind of store (a TCPStore
server, nothing else) and writes one key, `STANDALONE_KEY`, by which the agents of `hybridpar train` (and
torchrun's `--rdzv-backend hybridpar-c10d`) know they are its clients: they then print no warning and
reconnect when it restarts (topology/rdzv_client.py). It never reads what the agents store in it.
"""

from __future__ import annotations

import errno
import signal
import socket
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

from hybridpar.config.args import ArgParser, nonnegative_int

STANDALONE_KEY = "hybridpar/standalone_store"
DEFAULT_PORT = 29400  # torch's default for a c10d endpoint without a port
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}

USAGE = """usage: hybridpar rendezvous [--port 29400] [--host 127.0.0.1]

Hosts the rendezvous store of a multi-node run as a process of its own, so that the job survives the
loss of any training node (with the store inside a training agent, losing that agent's node ends the
job). Start it first, on a machine that is not a training node, then every node's agent as a client:

    hybridpar rendezvous --host 0.0.0.0 --port 29400            # on the store's machine
    hybridpar train --nnodes 1:4 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint STORE_HOST:29400 --rdzv-conf is_host=false --rdzv-id job42 ...

(plain torchrun: --rdzv-backend hybridpar-c10d, same endpoint and --rdzv-conf). is_host=false makes
every agent a client even if it starts before the store (it waits up to --rdzv-conf read_timeout, 60 s
by default, for the store to answer).

options:
  --port P    the port to listen on (default 29400; 0 picks a free one, printed)
  --host H    the address to listen on (default 127.0.0.1: this machine only). Give the address of
              the interface the training nodes reach (0.0.0.0: all): anyone who can reach the port
              can rewrite the rendezvous state, which the agents load with pickle (torch's format),
              so open it to the job's network only.

Restart: the store keeps its state in memory only; restarted (same host and port), it starts empty.
The running workers never use it and keep training. The agents reconnect within read_timeout, and the
first to reconnect writes back the rendezvous state it last saw (members, round, a fresh heartbeat
for each), so the job goes on as one; what is lost is a round's hand-over keys (rank assignments,
worker store address), read only while a round forms. Costs: while it is down no agent notices a
failed node or a new one (noticed after it is back); if it stays down past read_timeout the agents
stop their workers (SIGTERM: they checkpoint the step in flight) and exit with a line naming the
store (exit 143): restart it, then the agents with --checkpoint.resume auto. A restart while a round
forms can end its agents once a store read times out (start them again the same way), and one while the
agents wait for each other at the end can hold them up to torch's exit-barrier timeout (300 s). Stop
it with SIGTERM or Ctrl-C once the job is over. More: docs/multi-node.md."""


def parse_rendezvous_args(argv: list[str]) -> tuple[str, int]:
    """`[--port P] [--host H]` -> (host, port), or ValueError of one line."""
    ap = ArgParser(prog="hybridpar rendezvous", add_help=False)
    ap.add_argument("--port", type=nonnegative_int, default=DEFAULT_PORT)
    ap.add_argument("--host", default="127.0.0.1")
    a = ap.parse(argv)
    if a.port > 65535:
        raise ValueError(f"--port {a.port} is not a TCP port (0 to 65535)")
    return a.host, a.port


def listen_fd(host: str, port: int) -> int:
    """A listening socket on host:port (0: a free port), as a descriptor for TCPStore to own."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted store takes its port at once
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()  # TCPStore takes ownership; Python's socket object must not close it


def port_of(fd: int) -> int:
    s = socket.socket(fileno=fd)
    try:
        return s.getsockname()[1]
    finally:
        s.detach()


def host_store(host: str, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server listening on host:port only (port 0: a free one, see `.port`)."""
    fd = listen_fd(host, port)
    return dist.TCPStore(
        WILDCARDS.get(host, host),  # the server's own client connection: a wildcard is not an address
        port_of(fd),
        is_master=True,
        multi_tenant=True,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=fd,
        wait_for_workers=False,
    )


def serve(host: str, port: int, stop: threading.Event) -> None:
    """Host the standalone store until `stop` is set."""
    store = host_store(host, port)
    store.set(STANDALONE_KEY, "1")
    shown = f"[{host}]" if ":" in host else host
    print(f"hybridpar rendezvous: store listening on {shown}:{store.port}", flush=True)
    stop.wait()
    del store


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        host, port = parse_rendezvous_args(argv)
    except ValueError as e:
        print(f"hybridpar rendezvous: error: {e}\n\n{USAGE}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(host, port, stop)
    except OSError as e:  # the bind: the port taken, or an address this machine does not have
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            why += " (a store, or an agent hosting its own, listens there: start the store before the agents"
            why += ", or give another --port)"
        print(f"hybridpar rendezvous: error: cannot listen on {host}:{port}: {why}", file=sys.stderr)
        return 2
    return 0
