"""The adaptive microbatch policy: the split chosen at run time from measured throughput under a
memory budget (the interface every policy follows, and the fixed policy, are in fixed.py)."""

from __future__ import annotations

import math
from statistics import fmean, median
from typing import Any, Sequence

from hybridpar.batching.fixed import _Recorder
from hybridpar.batching.split import BatchPlan, split_evenly


class AdaptivePolicy(_Recorder):
    """Measure candidate microbatch counts, keep the fastest that fits the activation budget.

    Memory: the activation peak is taken as linear in the samples alive at once, the `in_flight`
    largest microbatches (1: one stage; pp: stage 0 under 1F1B; None: all, GPipe), and estimated
    conservatively: the larger of the max bytes/sample seen and the least-squares line through the
    per-size maxima. A candidate predicted over the budget is never proposed; before any peak is seen
    only the first candidate (the smallest microbatches) is.
    Throughput: every candidate runs `warmup_steps` unmeasured (allocator growth, autotuning), then
    `steps_per_candidate` measured, smallest microbatches first so memory is learnt before big ones
    run. The whole set is scanned: with unequal splits throughput need not be unimodal in the count
    (under 1F1B costs, 64 samples in 15 microbatches run slower than in 14 or 16).
    No split is locked in from one block of readings (on a shared machine one block can catch a quiet
    or a busy moment, issue 19): after the scan the leader by median is re-measured with the runner-up
    and whichever of the next two is within `drift_margin` of it, in alternating order, and the
    medians pool every block of a candidate. The scan ends once a re-checked leader beats every other by more than
    `switch_margin`, or after `max_passes` passes (then the best median, hysteresis applied).
    Hysteresis: a re-scan starts only when the current split's throughput falls by more than
    `drift_margin` (a rise only re-baselines), at least `cooldown_steps` after the last decision, and
    replaces the incumbent only if beaten by more than `switch_margin`. Memory does not wait: a split that
    stops fitting (OOM, a
    higher peak, a lower budget) is left at once for the best measured split that fits."""

    def __init__(
        self,
        global_batch: int,
        dp: int = 1,
        *,
        dp_rank: int = 0,
        memory_budget_bytes: int | None = None,
        memory_fraction: float | None = None,
        memory_total_bytes: int | None = None,
        memory_baseline_bytes: int = 0,
        min_microbatches: int = 1,
        count_multiple: int = 1,
        candidates: Sequence[int] | None = None,
        in_flight: int | None = 1,
        steps_per_candidate: int = 3,
        warmup_steps: int = 1,
        switch_margin: float = 0.03,
        drift_margin: float = 0.10,
        drift_window: int = 8,
        cooldown_steps: int = 50,
        max_passes: int = 4,
    ) -> None:
        if dp < 1 or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp={dp})")
        self.replicas = split_evenly(global_batch, dp)
        super().__init__(self.replicas[dp_rank])
        hi = min(self.replicas)  # every replica must be able to run the same count
        if not 1 <= min_microbatches <= hi or count_multiple < 1 or (in_flight is not None and in_flight < 1):
            raise ValueError(
                f"min_microbatches={min_microbatches} must be in [1, {hi}] (smallest replica "
                f"batch), count_multiple={count_multiple} >= 1, in_flight={in_flight} >= 1 or None"
            )
        if candidates is None:  # microbatch sizes 1, 2, 4, ... as counts, plus the schedule's minimum
            # From the smallest replica's batch, not this one's: every replica must hold the same list
            # to propose the same count each step (6 and 5 samples would give 6, 3, 2, 1 and 5, 3, 2, 1).
            candidates = {math.ceil(hi / 2**k) for k in range(hi.bit_length() + 1)} | {min_microbatches}
        cands = sorted(
            {m for m in candidates if min_microbatches <= m <= hi and m % count_multiple == 0}, reverse=True
        )  # most microbatches (smallest, safest) first
        if not cands:
            raise ValueError(
                f"no candidate count in {sorted(candidates)} lies in [{min_microbatches}, {hi}] "
                f"and is a multiple of {count_multiple}"
            )
        if (
            min(steps_per_candidate, drift_window, max_passes) < 1
            or min(warmup_steps, cooldown_steps) < 0
            or not 0 <= switch_margin < 1
            or not 0 < drift_margin < 1
        ):
            raise ValueError(
                f"need steps_per_candidate={steps_per_candidate}, drift_window={drift_window}, "
                f"max_passes={max_passes} >= 1, "
                f"warmup_steps={warmup_steps}, cooldown_steps={cooldown_steps} >= 0, "
                f"switch_margin={switch_margin} in [0, 1), drift_margin={drift_margin} in (0, 1)"
            )
        self.candidates, self.in_flight, self.count_multiple = cands, in_flight, count_multiple
        self.min_microbatches = min_microbatches
        self.k, self.warmup, self.margin = steps_per_candidate, warmup_steps, switch_margin
        self.drift_margin, self.drift_window, self.cooldown = drift_margin, drift_window, cooldown_steps
        self.max_passes, self._pass = max_passes, 1
        self.budget: float | None = None
        if memory_budget_bytes is not None or memory_fraction is not None:
            self.set_memory_budget(memory_budget_bytes, memory_fraction, memory_total_bytes, memory_baseline_bytes)
        self._peak_at: dict[int, int] = {}  # samples in flight -> max activation peak seen
        self._oom_x: int | None = None  # samples in flight at which an OOM happened: never again
        self.ooms: list[tuple[int, list[int]]] = []
        self.rounds, self._last_decision = 0, -(10**9)
        self._ref: float | None = None  # throughput of the split chosen last (set by each decision)
        self._scan(-1, self.candidates)

    def set_memory_budget(
        self,
        budget_bytes: float | None = None,
        fraction: float | None = None,
        total_bytes: int | None = None,
        baseline_bytes: int = 0,
    ) -> None:
        """Activation budget: bytes, or fraction x device total minus what stays resident anyway
        (weights, gradients, optimizer state: `baseline_bytes`). None: no budget, OOMs only."""
        if fraction is not None:
            if budget_bytes is not None or total_bytes is None or not 0 < fraction <= 1:
                raise ValueError(f"memory_fraction={fraction} needs memory_total_bytes and no explicit budget")
            budget_bytes = fraction * total_bytes - baseline_bytes
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"activation memory budget {budget_bytes} bytes must be > 0")
        self.budget = budget_bytes

    def samples_in_flight(self, sizes: Sequence[int]) -> int:
        k = len(sizes) if self.in_flight is None else min(self.in_flight, len(sizes))
        return sum(sorted(sizes, reverse=True)[:k])

    def predict_peak(self, sizes: Sequence[int]) -> float | None:
        if not self._peak_at:
            return None
        x = self.samples_in_flight(sizes)
        pred = max(p / xi for xi, p in self._peak_at.items()) * x
        if len(self._peak_at) >= 2:
            xs, ps = list(self._peak_at), list(self._peak_at.values())
            mx, mp = fmean(xs), fmean(ps)
            slope = sum((a - mx) * (b - mp) for a, b in zip(xs, ps)) / sum((a - mx) ** 2 for a in xs)
            pred = max(pred, mp + slope * (x - mx))
        return pred

    def fits(self, m: int) -> bool:
        sizes = split_evenly(self.batch, m)
        if self._oom_x is not None and self.samples_in_flight(sizes) >= self._oom_x:
            return False
        pred = self.predict_peak(sizes)
        return self.budget is None or pred is None or pred <= self.budget

    def _scan(
        self,
        step: int,
        queue: Sequence[int],
        incumbent: int | None = None,
        measured: dict[int, list[float]] | None = None,
        new_round: bool = True,
    ) -> None:
        """(Re)start or continue a scan over `queue`, keeping what is measured and still fits."""
        self.rounds += int(new_round)
        self._pass = 1 if new_round else self._pass
        self.exploring, self.incumbent = True, incumbent
        self._measured = {m: v for m, v in (measured or {}).items() if self.fits(m)}
        self._queue = [m for m in queue if self.fits(m) and m not in self._measured]
        if self._queue:
            self._set(self._queue[0])
        elif self._measured:
            self._end_pass(step)
        else:  # nothing fits the budget: run the smallest microbatches (statistics flag over_budget)
            self._queue = [self.candidates[0]]
            self._set(self.candidates[0])

    def _refit(self, step: int, first: int | None = None) -> None:
        """The split in use no longer fits. Measured throughputs stay valid under the new cap: a scan
        goes on with what fits; once converged, take the best measured split that fits, re-scanning
        (from `first`, the gentlest shrink) only if none does."""
        measured = {m: v for m, v in self._measured.items() if self.fits(m)}
        scan = self.exploring or not measured
        rest = (self._queue[1:] if self.exploring else self.candidates) if scan else []
        queue = list(dict.fromkeys(([first] if first is not None and scan else []) + rest))
        inc = self.incumbent if self.exploring and self.incumbent in measured else None
        self._scan(step, queue, inc, measured, new_round=not self.exploring and not measured)

    def _set(self, m: int) -> None:
        # _block: readings of this block (a re-check pass adds a block to a candidate's earlier readings)
        self.current, self._since_change, self._window, self._block = m, 0, [], 0

    def _finish_candidate(self, step: int) -> None:
        m, thr = self.current, self._measured[self.current]
        self.history.append(
            {
                "split": split_evenly(self.batch, m),
                "mean_throughput": fmean(thr),
                "median_throughput": median(thr),
                "steps": len(thr),
                "round": self.rounds,
                "pass": self._pass,
            }
        )
        self._queue = [q for q in self._queue[1:] if self.fits(q)]  # measured ones too: a re-check pass
        if self._queue:
            self._set(self._queue[0])
        else:
            self._end_pass(step)

    def _end_pass(self, step: int) -> None:
        """Every queued candidate is measured: decide, or re-check the leader (and whoever is close)."""
        med = {m: median(v) for m, v in self._measured.items()}
        ranked = sorted(med, key=lambda m: (med[m], m), reverse=True)
        leader, rest = ranked[0], ranked[1:]
        clear = all(med[m] * (1 + self.margin) < med[leader] for m in rest)
        if not rest or (self._pass > 1 and clear) or self._pass >= self.max_passes:
            self._decide(step, med)
            return
        # The runner-up is always re-checked once: its block may have caught a busy moment.
        runner_up = rest[:1] if self._pass == 1 else []
        close = [m for m in rest[:2] if med[m] >= med[leader] * (1 - self.drift_margin)]
        group = list(dict.fromkeys([leader] + runner_up + close))
        self._pass += 1
        # Alternate the order pass by pass: a machine getting steadily busier or quieter then favours
        # no candidate.
        self._queue = group if self._pass % 2 else group[::-1]
        self._set(self._queue[0])

    def _decide(self, step: int, med: dict[int, float]) -> None:
        best = max(med, key=lambda m: (med[m], m))  # ties: more microbatches (less memory)
        inc = self.incumbent
        if inc in med and best != inc and med[best] <= med[inc] * (1 + self.margin):
            best = inc  # hysteresis: a close call never moves us
        self.exploring, self._ref, self._last_decision = False, med[best], step
        if best != self.current:
            self._set(best)  # a real change: warm up again
        self._window = []
        self._converge(step)

    def propose(self, step: int) -> list[int]:
        return split_evenly(self.batch, self.current)

    def batch_plan(self, step: int) -> BatchPlan:
        """Every replica's split for this step, all with the current count (replica shares differ by
        at most one sample; dp_rank 0 holds the largest, the conservative one to fit memory on)."""
        return BatchPlan(tuple(tuple(split_evenly(r, self.current)) for r in self.replicas))

    def observe(
        self, step: int, sizes: Sequence[int], step_time_s: float, peak_activation_bytes: int | None, tokens: int
    ) -> None:
        obs = self._record(step, sizes, step_time_s, peak_activation_bytes, tokens)
        if peak_activation_bytes is not None:  # the warm-up step's peak counts too: it really happened
            x = self.samples_in_flight(sizes)
            self._peak_at[x] = max(self._peak_at.get(x, 0), peak_activation_bytes)
        if list(sizes) != self.propose(step):
            return  # not the split under test: memory evidence only
        self._since_change += 1
        if not self.fits(self.current) and any(map(self.fits, self.candidates)):
            self._refit(step)  # its own peak rules out the split we run, and a smaller one exists
            return
        if self._since_change <= self.warmup:
            return
        if self.exploring:
            self._measured.setdefault(self.current, []).append(obs.throughput)
            self._block += 1
            if self._block >= self.k:
                self._finish_candidate(step)
            return
        self._window = (self._window + [obs.throughput])[-self.drift_window :]
        if len(self._window) < self.drift_window:
            return
        now = median(self._window)
        if now > self._ref * (1 + self.drift_margin):
            # Faster than when chosen (warm caches, a quieter machine): nothing argues against the
            # split, and a re-scan would spend steps on the slower ones. Re-baseline instead.
            self._ref = now
        elif now < self._ref * (1 - self.drift_margin) and step - self._last_decision >= self.cooldown:
            self._scan(step, self.candidates, incumbent=self.current)

    def on_oom(self, step: int, sizes: Sequence[int]) -> list[int]:
        """`sizes` ran out of memory at `step`: cap the samples in flight below it and return the split
        to retry the same step with (same replica batch). Raises if one sample per microbatch fails."""
        if sum(sizes) != self.batch:
            raise ValueError(f"OOM sizes {list(sizes)} do not sum to the replica batch {self.batch}")
        x = self.samples_in_flight(sizes)
        self._oom_x = x if self._oom_x is None else min(self._oom_x, x)
        self.ooms.append((step, list(sizes)))
        fitting = [m for m in self.candidates if self.fits(m)]
        if not fitting:  # no candidate below: halve the largest microbatch
            half, hi = max(sizes) // 2, min(self.replicas)
            m = math.ceil(self.batch / max(half, 1))
            m = max(m + -m % self.count_multiple, self.candidates[-1])  # the schedule's minimum count
            if half < 1 or m > hi or not self.fits(m):
                raise RuntimeError(
                    f"out of memory with microbatches {list(sizes)} and no smaller split of "
                    f"{self.batch} samples (at most {hi} microbatches) exists"
                )
            self.candidates = sorted(set(self.candidates) | {m}, reverse=True)
            fitting = [m]
        self._refit(step, max(fitting, key=lambda q: (self.samples_in_flight(split_evenly(self.batch, q)), -q)))
        return self.propose(step)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the policy (JSON): what it measured and where its scan stands."""
        return {
            "version": 1,
            "batch": self.batch,
            "replicas": self.replicas,
            "candidates": self.candidates,
            "peak_at": sorted(self._peak_at.items()),
            "oom_x": self._oom_x,
            "ooms": self.ooms,
            "rounds": self.rounds,
            "last_decision": self._last_decision,
            "exploring": self.exploring,
            "incumbent": self.incumbent,
            "measured": sorted(self._measured.items()),
            "queue": self._queue,
            "pass": self._pass,
            "current": self.current,
            "block": self._block,
            "window": self._window,
            "ref": self._ref,
            "recorder": {
                "steps": self.steps,
                "sum_time": self._sum_time,
                "sum_thr": self._sum_thr,
                "history": self.history,
                "converged_step": self.converged_step,
                "steps_to_converge": self.steps_to_converge,
            },
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Continue from `state_dict()` of a policy over the same batch and replicas (ValueError, naming
        the difference, otherwise: start afresh then). The current split warms up again, unmeasured:
        a restarted process runs its first steps on cold caches and a fresh allocator."""
        if d.get("version") != 1:
            raise ValueError(f"policy state version {d.get('version')!r}, this build reads version 1")
        if d["batch"] != self.batch or list(d["replicas"]) != self.replicas:
            raise ValueError(f"policy state is for replica batches {d['replicas']}, this run has {self.replicas}")
        cands = [int(m) for m in d["candidates"]]
        # A different schedule or pp changes the counts that may run: candidates must all still be allowed.
        least = self.min_microbatches
        bad = [m for m in cands if not least <= m <= min(self.replicas) or m % self.count_multiple]
        if bad or int(d["current"]) not in cands:
            raise ValueError(
                f"policy state proposes microbatch counts {bad or [d['current']]} that this run's "
                f"schedule does not allow (counts from {least} to {min(self.replicas)}, "
                f"multiples of {self.count_multiple})"
            )
        self.candidates = cands
        self._peak_at = {int(x): int(p) for x, p in d["peak_at"]}
        self._oom_x = d["oom_x"]
        self.ooms = [(int(s), list(z)) for s, z in d["ooms"]]
        self.rounds, self._last_decision, self.exploring = d["rounds"], d["last_decision"], d["exploring"]
        self.incumbent = d["incumbent"]
        self._measured = {int(m): list(v) for m, v in d["measured"]}
        self._queue = [int(m) for m in d["queue"]]
        self._pass = int(d.get("pass", 1))  # states written before re-check passes existed
        self._set(int(d["current"]))
        self._block = int(d.get("block", 0))
        self._window = list(d["window"])
        self._ref = d["ref"]
        r = d["recorder"]
        self.steps, self._sum_time, self._sum_thr = r["steps"], r["sum_time"], r["sum_thr"]
        self.history, self.converged_step, self.steps_to_converge = (
            r["history"],
            r["converged_step"],
            r["steps_to_converge"],
        )

    def statistics(self) -> dict[str, Any]:
        out = self._stats("adaptive", self.propose(0), not self.exploring)
        pred = self.predict_peak(self.propose(0))
        per_sample = max((p / x for x, p in self._peak_at.items()), default=None)
        out.update(
            rounds=self.rounds,
            candidates=list(self.candidates),
            memory_budget_bytes=self.budget,
            predicted_peak_bytes=pred,
            bytes_per_sample=per_sample,
            ooms=list(self.ooms),
            over_budget=None not in (self.budget, pred) and pred > self.budget,
        )
        return out
