"""From a schedule's name to the action lists the runtime executes: the registered builder's compute
actions (`compute_schedule`), lowered to sends and receives in NCCL-safe link order for any stage
placement (`add_communication`), and validated (`build_schedule`). Also what is read off a schedule
without running it: its bubble formula under uniform costs, and how many activations a rank holds.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from hybridpar.pipeline.schedules.actions import Action, Op, compute_of, placement, recv_of, send_after
from hybridpar.pipeline.schedules.registry import schedule_spec
from hybridpar.pipeline.schedules.validator import validate_schedule


def _check_counts(pp: int, virtual_stages: int, microbatches: int) -> None:
    for label, value in (("pp", pp), ("virtual_stages", virtual_stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")


def compute_schedule(name: str, pp: int, virtual_stages: int, microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the ordered compute actions (F and B; also W for zero-bubble)."""
    spec = schedule_spec(name)
    _check_counts(pp, virtual_stages, microbatches)
    spec.check(pp, virtual_stages, microbatches)
    return spec.builder(pp, virtual_stages, microbatches)


def add_communication(
    compute: list[list[Action]], pp: int, n_stages: int, recv_lookahead: int = 1, *, ranks: Sequence[int] | None = None
) -> list[list[Action]]:
    """Lower per-rank compute lists to full lists with SEND_*/RECV_* inserted."""
    if len(compute) != pp:
        raise ValueError(f"expected {pp} rank lists, got {len(compute)}")
    if recv_lookahead < 0:
        raise ValueError(f"recv_lookahead must be >= 0, got {recv_lookahead}")
    ranks = placement(ranks, pp, n_stages)
    sends = [[send_after(a, ranks) for a in acts] for acts in compute]
    # NCCL matches p2p messages per (src, dst) pair in posting order, so the receiver's
    # order on a link is dictated by the sender's list order.
    link_recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for send in (x for row in sends for x in row if x is not None):
        # message_of's link of a send, without building its pair of candidate senders per message
        dst = send.stage + 1 if send.op is Op.SEND_F else send.stage - 1
        link_recvs[ranks[send.stage], ranks[dst]].append(recv_of(send))

    out: list[list[Action]] = []
    for dst, acts in enumerate(compute):
        pos = {a: i for i, a in enumerate(acts)}
        # post_at[i]: receives to post right before compute i (i == len(acts): at the end,
        # only reachable for a malformed input whose consumer is missing).
        post_at: list[list[Action]] = [[] for _ in range(len(acts) + 1)]
        for link in sorted(link_recvs):
            if link[1] != dst:
                continue
            queue = link_recvs[link]
            # Receive j is due at step need_j - lookahead, but cannot overtake any later
            # receive on the link that is due sooner: a suffix minimum keeps link order.
            due = len(acts)
            slots: list[int] = []
            for recv in reversed(queue):
                due = min(due, max(0, pos.get(compute_of(recv), len(acts)) - recv_lookahead))
                slots.append(due)
            for recv, slot in zip(queue, reversed(slots)):
                post_at[slot].append(recv)
        full: list[Action] = []
        for i, a in enumerate(acts):
            send = sends[dst][i]
            full += post_at[i]
            full.append(a)
            if send is not None:
                full.append(send)
        out.append(full + post_at[len(acts)])
    return out


def build_schedule(
    name: str, pp: int, virtual_stages: int, microbatches: int, recv_lookahead: int = 1
) -> list[list[Action]]:
    """The full, validated per-rank action lists the runtime executes."""
    compute = compute_schedule(name, pp, virtual_stages, microbatches)
    n_stages, ranks = pp * virtual_stages, schedule_spec(name).stage_ranks(pp, virtual_stages)
    full = add_communication(compute, pp, n_stages, recv_lookahead, ranks=ranks)
    validate_schedule(full, pp, n_stages, microbatches, ranks=ranks)
    return full


def bubble_fraction_theory(
    name: str, pp: int, virtual_stages: int, microbatches: int, *, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0
) -> float:
    """Idle fraction of the total step time per rank, assuming uniform stage costs: the schedule's
    registered formula (its ScheduleSpec's `bubble`). t_b is the input-gradient half B and t_w the weight half W
    where the schedule splits the backward; elsewhere a full backward is t_b + t_w."""
    _check_counts(pp, virtual_stages, microbatches)
    return schedule_spec(name).bubble_fraction(pp, virtual_stages, microbatches, t_f=t_f, t_b=t_b, t_w=t_w)


def max_in_flight(actions: list[list[Action]]) -> int:
    """Most microbatch activations any rank holds at once: a forward's saved tensors live until its
    backward (B) frees the graph. The microbatch planner's memory model multiplies bytes per sample
    by the samples of this many (largest) microbatches."""
    peak = 0
    for rank in actions:
        alive = 0
        for a in rank:
            alive += (a.op == Op.FORWARD) - (a.op == Op.BACKWARD)
            peak = max(peak, alive)
    return peak
