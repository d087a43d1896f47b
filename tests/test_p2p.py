"""The pipeline's P2P messages: posted from the posting thread (CPU) or inline, every message arrives
whole and in order, and a message that cannot be posted fails where it is waited for, naming its peer."""

from __future__ import annotations

import pytest

from hybridpar.testing import run_ranks


def _exchange(threaded: bool) -> dict:
    import torch

    from hybridpar.pipeline.p2p import P2P
    from hybridpar.topology.mesh import build_topology

    topo = build_topology(1, 2, 1, "gloo", 20.0)
    me, peer = topo.rank, 1 - topo.rank
    p2p = P2P(topo.device, torch.float32, 20.0, post_from_thread=threaded)
    got = []
    # Both ranks send and receive in every flush; shapes vary so a message matched out of order
    # would land in a buffer of the wrong size or carry the wrong values.
    for i in range(24):
        shape = (1 + i % 3, 5)
        p2p.queue_send(torch.full(shape, 100.0 * me + i), peer)
        p2p.queue_recv(i, shape, peer)
        if i % 4 == 3:
            p2p.flush()
            for j in range(i - 3, i + 1):
                buf = p2p.wait_recv(j)
                got.append((tuple(buf.shape), float(buf.min()), float(buf.max())))
                p2p.release(buf)
    p2p.wait_sends()
    alive = p2p._thread is not None and p2p._thread.is_alive()
    p2p.close()
    st = p2p.stats[peer]
    return {"got": got, "thread_alive_before_close": alive, "closed": p2p._thread is None,
            "sent": st.sent_msgs, "received": st.recv_msgs, "pending": p2p.pending()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threaded", [True, False])
def test_messages_arrive_whole_and_in_order(threaded):
    for rank, res in enumerate(run_ranks(_exchange, 2, threaded, timeout_s=90)):
        other = 100.0 * (1 - rank)
        assert res["got"] == [[[1 + i % 3, 5], other + i, other + i] for i in range(24)]
        assert res["sent"] == res["received"] == 24 and res["pending"] == 0
        assert res["thread_alive_before_close"] is threaded and res["closed"]


def _bad_peer() -> str | None:
    import torch

    from hybridpar.pipeline.p2p import P2P
    from hybridpar.topology.mesh import build_topology

    topo = build_topology(1, 2, 1, "gloo", 10.0)
    p2p = P2P(topo.device, torch.float32, 10.0)
    for peer in (7, topo.rank):  # world size 2: there is no rank 7, and a rank does not message itself
        try:
            p2p.queue_send(torch.ones(3), peer)
            return "no error"
        except ValueError as e:
            assert f"P2P peer {peer} is not another rank of this world (ranks 0..1, this is rank {topo.rank})" in str(e)
    return None


@pytest.mark.timeout(120)
def test_a_peer_outside_the_world_is_refused_before_posting():
    assert run_ranks(_bad_peer, 2, timeout_s=90) == [None, None]


def test_a_message_the_posting_thread_cannot_post_fails_at_its_wait():
    import torch
    import torch.distributed as dist

    from hybridpar.pipeline.p2p import P2P

    assert not dist.is_initialized()  # no process group: the posting thread's send itself fails
    p2p = P2P(torch.device("cpu"), torch.float32, 5.0, post_from_thread=True)
    p2p.queue_send(torch.ones(3), 1)
    p2p.queue_recv("x", (3,), 1)
    with pytest.raises(RuntimeError, match="P2P: posting receive x from rank 1 failed"):
        p2p.wait_recv("x")
    with pytest.raises(RuntimeError, match="P2P: posting a send to rank 1 failed"):
        p2p.wait_sends()
    p2p.close()
