"""Rendezvous that listens on loopback only.

torch's TCPStore server listens on every interface, and torchrun's c10d rendezvous creates two of them
(the rendezvous store and the store shared with the workers). For single-machine runs we bind the
listening socket ourselves to 127.0.0.1 and hand it to TCPStore (`master_listen_fd`), so nothing is
reachable from the network unless the user passes a rendezvous endpoint of their own.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

LOOPBACK_BACKEND = "hybridpar-loopback"


def loopback_store(port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server bound to 127.0.0.1:port (0 picks a free port; see `.port`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    # TCPStore takes ownership of the descriptor; detach so Python's socket object does not close it.
    fd = sock.detach()
    return dist.TCPStore(
        "127.0.0.1",
        _port_of(fd),
        is_master=True,
        multi_tenant=True,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=fd,
        wait_for_workers=False,
    )


def _port_of(fd: int) -> int:
    s = socket.socket(fileno=fd)
    try:
        return s.getsockname()[1]
    finally:
        s.detach()


def _create_loopback_handler(params):  # -> RendezvousHandler
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    port = int(params.endpoint.rsplit(":", 1)[1]) if ":" in params.endpoint else 0

    class _LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the handler checks that it matches --rdzv-backend
            return LOOPBACK_BACKEND

    store = loopback_store(port, float(params.get("read_timeout", 60)))
    handler = create_handler(store, _LoopbackBackend(store, params.run_id), params)
    # The handler also starts the store the workers share (MASTER_ADDR/PORT); bind that one to
    # loopback too. `_create_tcp_store_server` is the (private) hook torch uses for it.
    handler._create_tcp_store_server = lambda addr, port: loopback_store(port)
    return handler


def register_loopback_rendezvous() -> None:
    """Make `--rdzv-backend hybridpar-loopback` available to torch.distributed.run in this process."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    try:
        rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create_loopback_handler)
    except ValueError:
        pass  # already registered in this process


def torchrun_handler():  # entry point "torchrun.handlers": plain `torchrun --rdzv-backend hybridpar-loopback`
    return _create_loopback_handler
