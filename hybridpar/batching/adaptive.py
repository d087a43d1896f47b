"""The adaptive microbatch policy: the split chosen at run time from measured throughput under a
memory budget (the interface every policy follows, and the fixed policy, are in fixed.py)."""

from __future__ import annotations

import math
from statistics import fmean, median
from typing import Any, Sequence

from hybridpar.batching.fixed import _Recorder
from hybridpar.batching.race import Verdict, block_value, judge
from hybridpar.batching.split import split_evenly


def candidate_counts(
    hi: int, min_microbatches: int, count_multiple: int, in_flight: int | None, candidates: Sequence[int] | None
) -> list[int]:
    """The microbatch counts the policy may propose (`candidates`, or its default list) that lie in
    [`min_microbatches`, `hi`] and are multiples of `count_multiple`, most microbatches (smallest,
    safest) first; ValueError naming the settings when none is left or a setting is out of range."""
    if not 1 <= min_microbatches <= hi or count_multiple < 1 or (in_flight is not None and in_flight < 1):
        raise ValueError(
            f"min_microbatches={min_microbatches} must be in [1, {hi}] (smallest replica "
            f"batch), count_multiple={count_multiple} >= 1, in_flight={in_flight} >= 1 or None"
        )
    if candidates is None:  # microbatch sizes 1, 2, 4, ... as counts, plus every count from the
        # schedule's minimum to twice it: near the minimum the pipeline bubble and the per-microbatch
        # cost trade off most finely (issue 19: 7 microbatches beat 4 and 8 at pp4 under load).
        # From the smallest replica's batch, not this one's: every replica must hold the same list
        # to propose the same count each step (6 and 5 samples would give 6, 3, 2, 1 and 5, 3, 2, 1).
        candidates = {math.ceil(hi / 2**k) for k in range(hi.bit_length() + 1)}
        candidates |= set(range(min_microbatches, 2 * min_microbatches))
    cands = sorted({m for m in candidates if min_microbatches <= m <= hi and m % count_multiple == 0}, reverse=True)
    if not cands:
        raise ValueError(
            f"no candidate count in {sorted(candidates)} lies in [{min_microbatches}, {hi}] "
            f"and is a multiple of {count_multiple}"
        )
    return cands


class AdaptivePolicy(_Recorder):
    """Measure candidate microbatch counts, keep the fastest that fits the activation budget.

    Memory: the activation peak is taken as linear in the samples alive at once, the `in_flight`
    largest microbatches (1: one stage; pp: stage 0 under 1F1B; None: all, GPipe), and estimated
    conservatively: the larger of the max bytes/sample seen and the least-squares line through the
    per-size maxima. A candidate predicted over the budget is never proposed; before any peak is seen
    only the first candidate (the smallest microbatches) is.
    Throughput: a race (race.py). Every candidate runs `warmup_steps` unmeasured (allocator growth,
    autotuning), then a block of `steps_per_candidate` measured steps, smallest microbatches first so
    memory is learnt before big ones run. The whole set is scanned: with unequal splits throughput need
    not be unimodal in the count. No split is chosen from one block (on a shared machine a block can
    catch a quiet or a busy spell, one step can be 3x slow: issue 19): the best `keep` of the scan are
    measured again, and pass by pass, in alternating order, the candidates the block medians do not
    show slower than the leader (by `z` standard errors, noise estimated from the blocks themselves)
    are measured again, until one is left, all left are within `switch_margin` of the leader, or
    `max_passes` passes ran (then the best estimate).
    Hysteresis: the incumbent of a re-scan stays unless beaten by more than `switch_margin`. Once
    decided, throughput is watched in disjoint windows of `drift_window` steps: two medians in a row
    below the baseline (the median of the last steady windows) by more than `drift_margin`, at least
    `cooldown_steps` after the decision, re-scan every candidate afresh (the machine changed); a rise
    only re-baselines. `recheck_steps` after a decision the winner races the next other split again,
    afresh; while the winner leads, that race ends after `recheck_passes` passes (a rival in the lead
    is raced on, up to `max_passes`, and becomes the winner if shown faster). Every `keep` re-checks
    in a row that keep the winner double the interval, up to 8x, so their cost (2 * recheck_passes *
    (warmup + steps_per_candidate) steps, half on the rival) is a small and shrinking share of a long
    run: at a fixed 500-step interval and up to
    8 passes, re-checks cost ~1-2% of throughput on a noisy machine. Memory does not wait: a split that
    stops fitting (OOM, a higher peak, a lower budget) is left at once for the best measured split
    that fits. The memory rule is `fits()`: every proposal goes through it."""

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
        max_passes: int = 8,
        recheck_passes: int = 2,
        keep: int = 3,
        z: float = 2.0,
        noise_prior: float = 0.05,
        recheck_steps: int = 500,
    ) -> None:
        if dp < 1 or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp={dp})")
        self.replicas = split_evenly(global_batch, dp)
        super().__init__(self.replicas[dp_rank])
        # Every replica must be able to run the same count: counts up to the smallest replica's batch.
        cands = candidate_counts(min(self.replicas), min_microbatches, count_multiple, in_flight, candidates)
        if (
            min(steps_per_candidate, drift_window, max_passes, recheck_passes, keep, recheck_steps) < 1
            or min(warmup_steps, cooldown_steps) < 0
            or not 0 <= switch_margin < 1
            or not 0 < drift_margin < 1
            or not (z > 0 and noise_prior > 0)
        ):
            raise ValueError(
                f"need steps_per_candidate={steps_per_candidate}, drift_window={drift_window}, "
                f"max_passes={max_passes}, recheck_passes={recheck_passes}, keep={keep}, "
                f"recheck_steps={recheck_steps} >= 1, "
                f"warmup_steps={warmup_steps}, cooldown_steps={cooldown_steps} >= 0, "
                f"switch_margin={switch_margin} in [0, 1), drift_margin={drift_margin} in (0, 1), "
                f"z={z} and noise_prior={noise_prior} > 0"
            )
        self.candidates, self.in_flight, self.count_multiple = cands, in_flight, count_multiple
        self.min_microbatches = min_microbatches
        self.k, self.warmup = steps_per_candidate, warmup_steps
        self.drift_margin, self.drift_window, self.cooldown = drift_margin, drift_window, cooldown_steps
        self.max_passes, self.recheck_passes, self._pass = max_passes, recheck_passes, 1
        self.race = dict(margin=switch_margin, z=z, noise_prior=noise_prior, keep=keep)
        self.recheck_steps, self.rechecks, self.explore_steps = recheck_steps, 0, 0
        self._confirmed = 0  # re-checks in a row that kept the winner: they space the next (docstring)
        self.drifts: list[dict[str, float]] = []  # each drift that started a re-scan: step, medians, band
        self._challengers: list[int] = []  # the others of the last race, next to be raced again first
        self.budget: float | None = None
        if memory_budget_bytes is not None or memory_fraction is not None:
            self.set_memory_budget(memory_budget_bytes, memory_fraction, memory_total_bytes, memory_baseline_bytes)
        self._peak_at: dict[int, int] = {}  # samples in flight -> max activation peak seen
        self._oom_x: int | None = None  # samples in flight at which an OOM happened: never again
        self.ooms: list[tuple[int, list[int]]] = []
        self.rounds, self._last_decision, self._last_check, self._drift = 0, -(10**9), -(10**9), drift_margin
        # Drift baseline: the median of the last few steady windows since the decision (one window is
        # as noisy as the one tested against it: a lucky first window made later ones look slow).
        self._refs: list[float] = []
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
        blocks: dict[int, list[float]] | None = None,
        new_round: bool = True,
        recheck: bool = False,
    ) -> None:
        """(Re)start or continue a race over `queue`, keeping block values that still fit."""
        self.rounds += int(new_round and not recheck)
        self.rechecks += int(recheck)
        self._recheck = recheck if new_round else self._recheck
        self._pass = 1 if new_round else self._pass
        self.exploring, self.incumbent = True, incumbent
        self._blocks = {m: v for m, v in (blocks or {}).items() if self.fits(m)}
        self._queue = [m for m in queue if self.fits(m) and m not in self._blocks]
        if self._queue:
            self._set(self._queue[0])
        elif self._blocks:
            self._end_pass(step)
        else:  # nothing fits the budget: run the smallest microbatches (statistics flag over_budget)
            self._queue = [self.candidates[0]]
            self._set(self.candidates[0])

    def _refit(self, step: int, first: int | None = None) -> None:
        """The split in use no longer fits. Measured throughputs stay valid under the new cap: a race
        goes on with what fits; once decided, take the best measured split that fits, re-scanning
        (from `first`, the gentlest shrink) only if none does."""
        blocks = {m: v for m, v in self._blocks.items() if self.fits(m)}
        scan = self.exploring or not blocks
        rest = (self._queue[1:] if self.exploring else self.candidates) if scan else []
        queue = list(dict.fromkeys(([first] if first is not None and scan else []) + rest))
        inc = self.incumbent if self.exploring and self.incumbent in blocks else None
        self._scan(step, queue, inc, blocks, new_round=not self.exploring and not blocks)

    def _set(self, m: int) -> None:
        # _readings: the block being measured (a later pass adds another block to the candidate)
        self.current, self._since_change, self._window, self._readings = m, 0, [], []
        self._strikes = 0  # windows in a row beyond drift_margin: > 0 faster, < 0 slower

    def _finish_block(self, step: int) -> None:
        m, thr = self.current, self._readings
        self._blocks.setdefault(m, []).append(block_value(thr))
        self.history.append(
            {
                "split": split_evenly(self.batch, m),
                "median_throughput": median(thr),
                "steps": len(thr),
                "round": self.rounds,
                "recheck": self.rechecks,
                "pass": self._pass,
            }
        )
        self._queue = [q for q in self._queue[1:] if self.fits(q)]
        if self._queue:
            self._set(self._queue[0])
        else:
            self._end_pass(step)

    def _end_pass(self, step: int) -> None:
        """Every queued candidate has a new block: decide, or race the survivors again."""
        v = judge(self._blocks, **self.race)
        # The leader must have been measured in two blocks: a lone lucky block never wins.
        confirmed = len(self._blocks[v.leader]) > 1 or len(self._blocks) == 1
        # A re-check stops early while the winner leads: the rival was not shown faster, and a re-check
        # that found none is the common case. A rival in the lead is raced on, up to max_passes.
        cap = self.recheck_passes if self._recheck and v.leader == self.incumbent else self.max_passes
        if (v.settled and confirmed) or self._pass >= cap:
            self._decide(step, v)
            return
        self._pass += 1
        # Alternate the order pass by pass: a machine getting steadily busier or quieter then favours
        # no candidate.
        self._queue = v.survivors if self._pass % 2 else v.survivors[::-1]
        self._set(self._queue[0])

    def _decide(self, step: int, v: Verdict) -> None:
        est, best, inc = v.estimates, v.leader, self.incumbent
        close = inc in est and est[best] - est[inc] <= math.log1p(self.race["margin"])
        if best != inc and (close or (self._recheck and inc in v.survivors)):
            # Hysteresis: a close call never moves us; a re-check (no drift seen) moves us only when
            # it shows the incumbent slower, or every re-check would be another chance to pick wrong.
            best = inc
        self.exploring, self._last_check = False, step
        if self._recheck and best == inc:  # confirmed again: a re-check that keeps the split keeps its baseline
            self._confirmed += 1
        else:  # a new decision: re-checks start afresh
            self._confirmed = 0
            if self._recheck:
                # The rival was shown faster than the winner: move to it, the old winner challenges
                # first. No full re-scan: with every count near the minimum among the candidates most
                # such re-checks are between splits a few % apart, and a re-scan would also re-measure
                # splits far slower (1 x 64: 40% of the best). A third split that overtook both is
                # found by the next re-checks; a machine that changed under the winner, by drift.
                self._challengers = [inc] + [m for m in self._challengers if m not in (inc, best)]
            else:
                # Re-checks race the winner against the others in turn, best first: a split dropped by
                # bad luck, or one that got faster since, is not out for good.
                self._challengers = sorted((m for m in est if m != best), key=lambda m: (est[m], m), reverse=True)
            # The baseline for drift is steady state's windows, not the race's estimate: the winner's
            # estimate is biased high (it won partly by luck), a drift test against it fires. What
            # counts as drift: drift_margin, or 3 standard errors of the difference of two
            # window medians if the race found the machine noisier than that (a block value is the
            # median of k readings, a window's of drift_window).
            self._refs, self._last_decision = [], step
            spread = 3 * math.sqrt(2 * self.k / self.drift_window) * (v.noise or 0.0)
            self._drift = min(max(self.drift_margin, math.expm1(spread)), 0.5)
        if best != self.current:
            self._set(best)  # a real change: warm up again
        self._window, self._strikes = [], 0
        self._converge(step)

    def propose(self, step: int) -> list[int]:
        return split_evenly(self.batch, self.current)

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
            self.explore_steps += 1
            r = self._readings
            r.append(obs.throughput)
            # A block whose median reading is far below its best (most of its steps hit something
            # else's job, 0.7% of blocks at 5% of steps 3x slow) is measured on, up to 3k steps:
            # one such block must not drop a split from a race.
            doubtful = median(r) * 1.5 < max(r) and len(r) < 3 * self.k
            if len(r) >= self.k and not doubtful:
                self._finish_block(step)
            return
        self._window.append(obs.throughput)
        if len(self._window) < self.drift_window:
            return
        # Disjoint windows: one test per window, not one per step over overlapping ones (on a noisy
        # machine a sliding median crosses any threshold sooner or later).
        now, self._window = median(self._window), []
        since = step - self._last_decision
        if len(self._refs) < 3:  # the baseline first: three windows, so one lucky window cannot be it
            self._refs.append(now)
            return
        # A move counts once two windows in a row agree on its direction: one busy or quiet window
        # is noise, not a changed machine. Windows within the band join the baseline (the last 8).
        ref, band = median(self._refs), self._band()
        sign = (now > ref * (1 + band)) - (now < ref * (1 - band))
        self._strikes = self._strikes + sign if sign and sign * self._strikes >= 0 else sign
        self._refs = self._refs if sign else (self._refs + [now])[-8:]
        if self._strikes >= 2:
            # Faster than when chosen (warm caches, a quieter machine): nothing argues against the
            # split, and a re-scan would spend steps on the slower ones. Re-baseline instead.
            self._refs, self._strikes = [now], 0
        elif self._strikes <= -2 and since >= self.cooldown:
            # Kept for the record: a re-scan on noise shows up as a window barely past its band.
            self.drifts.append({"step": step, "baseline": ref, "window": now, "band": band})
            self._scan(step, self.candidates, incumbent=self.current)
        elif step - self._last_check >= self._recheck_interval() and any(map(self.fits, self._challengers)):
            # The winner, re-checked: another split may have become faster without this one slowing.
            rival = next(m for m in self._challengers if self.fits(m))
            self._challengers = [m for m in self._challengers if m != rival] + [rival]
            self._scan(step, [self.current, rival], incumbent=self.current, recheck=True)

    def _band(self) -> float:
        """How far a window's median may stray from the baseline before it counts as a move: the drift
        margin of the decision, or three robust standard deviations of the baseline windows themselves,
        whichever is wider. The race's noise covers steps that are noisy one by one; a machine whose
        load comes and goes over tens of steps moves whole windows together, which only the windows
        show (synthetic load of that kind re-scanned 20-35% of runs per 1,000 steps without this)."""
        logs = [math.log(x) for x in self._refs]
        mid = median(logs)
        spread = 1.4826 * median(abs(x - mid) for x in logs)
        return min(max(self._drift, math.expm1(3 * spread)), 0.5)

    def _recheck_interval(self) -> int:
        """Steps from a decision or re-check to the next re-check: `recheck_steps`, doubled for every
        `keep` re-checks in a row that kept the winner, at most 8x. Per `keep`, not per full cycle of
        the others: challengers go best first, and with many candidates (every count up to twice the
        schedule's minimum) a full cycle would re-check splits far slower at the short interval."""
        cycles = self._confirmed // max(1, min(self.race["keep"], len(self._challengers)))
        return self.recheck_steps * 2 ** min(cycles, 3)

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
            "version": 2,
            "batch": self.batch,
            "replicas": self.replicas,
            "candidates": self.candidates,
            "peak_at": sorted(self._peak_at.items()),
            "oom_x": self._oom_x,
            "ooms": self.ooms,
            "rounds": self.rounds,
            "rechecks": self.rechecks,
            "recheck": self._recheck,
            "confirmed": self._confirmed,
            "drifts": self.drifts,
            "explore_steps": self.explore_steps,
            "challengers": self._challengers,
            "last_decision": self._last_decision,
            "last_check": self._last_check,
            "exploring": self.exploring,
            "incumbent": self.incumbent,
            "blocks": sorted(self._blocks.items()),
            "queue": self._queue,
            "pass": self._pass,
            "current": self.current,
            "readings": self._readings,
            "window": self._window,
            "strikes": self._strikes,
            "refs": self._refs,
            "drift": self._drift,
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
        if d.get("version") != 2:
            raise ValueError(f"policy state version {d.get('version')!r}, this build reads version 2")
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
        self._last_check = d["last_check"]
        self.rechecks, self.explore_steps = d["rechecks"], d["explore_steps"]
        self._challengers = [int(m) for m in d["challengers"]]
        self._recheck = bool(d["recheck"])
        self._confirmed = int(d.get("confirmed", 0))  # absent in a state saved before the back-off
        self.drifts = list(d.get("drifts", []))
        self.incumbent = d["incumbent"]
        self._blocks = {int(m): list(v) for m, v in d["blocks"]}
        self._queue = [int(m) for m in d["queue"]]
        self._pass = int(d["pass"])
        self._set(int(d["current"]))
        self._readings = list(d["readings"])
        self._window, self._strikes = list(d["window"]), int(d["strikes"])
        # A state saved before the baseline became a list holds one window as "ref".
        self._refs = list(d["refs"]) if "refs" in d else [d["ref"]] if d.get("ref") is not None else []
        self._drift = float(d["drift"])
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
            rechecks=self.rechecks,
            drifts=list(self.drifts),
            explore_steps=self.explore_steps,
            candidates=list(self.candidates),
            memory_budget_bytes=self.budget,
            predicted_peak_bytes=pred,
            bytes_per_sample=per_sample,
            ooms=list(self.ooms),
            over_budget=None not in (self.budget, pred) and pred > self.budget,
        )
        return out
