"""Sequence parallelism (`parallel.sequence_parallel`): activations of the regions it shards, the whole
step's activation peak, step time and pipeline message bytes, with and without it, side by side (JSON).

    .venv/bin/hybridpar bench sequence_parallel [--family llama|gpt2] [--layout 2x2x1] [--seq-len 1024]
        [--rounds 4] [--steps 2] [--compare sp|sp_backward|rebuild] [--kv-heads N] [--precision fp32|bf16]
        [--json FILE]

The layout is TPxPPxDP (tp >= 2), the model the default one of the family. Each rank builds two trainers,
one without and one with sequence parallelism (same seed, same data), and runs rounds of blocks of steps,
one block per trainer, the order alternating every round (round 0 warms both up and is not counted), so
a shared machine's drift hits both alike. `--compare sp_backward`: both trainers run sequence parallelism,
"off" keeping the column-parallel layers' gathered inputs (`parallel.sp_backward saved`), "on" their 1/tp
slices, all-gathered again in the backward (`regather`, model/regather.py). `--compare rebuild`: both with
sequence parallelism (re-gathering), "off" keeping every saved tensor (`train.rebuild_saved false`), "on"
rebuilding the cheap ones in the backward (model/regather.py; llama only: GPT-2 has nothing to rebuild).

- Sharded regions: bytes that the modules between the tp-sharded matmuls — leaf modules whose parameters
  are all replicated over tp: the norms, GPT-2's position table — save for backward per step, read from
  the activation meter (pipeline/activation_meter.py) around each of their forwards; max over ranks.
- Whole step: the activation meter's peak (max over ranks), as each step's record reports it.
- P2P: bytes this rank sent to other pipeline stages per step (pipeline/p2p.py's per-link counters),
  max over ranks; with sequence parallelism each message holds 1/tp of the sequence.
- Time: median step time per trainer, and per round the block median over the baseline's (median of
  ratios, with their spread); CPU process time per step summed over ranks beside it, since wall time on
  a loaded machine mostly measures the wait for a core. The load average is taken before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from torch import nn

from hybridpar.bench import emit, layout_config
from hybridpar.config import Config
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.topology.spawn import run_ranks

MODES = ("off", "on")
COMPARE = {
    "sp": "off: no SP; on: SP",
    "sp_backward": "SP; off: sp_backward saved, on: regather",
    "rebuild": "SP; off: train.rebuild_saved false, on: true",
}


class RegionTally:
    """Bytes saved for backward inside the sequence-sharded regions: the meter's growth across each
    forward of a leaf module whose parameters are all replicated over tp (nothing is released inside)."""

    def __init__(self, trainer: object) -> None:
        from hybridpar.model.tp import is_sharded

        self.meter = trainer.runtime.meter  # type: ignore[attr-defined]
        self.saved = 0
        self._at: dict[int, int] = {}
        for st in trainer.stages.values():  # type: ignore[attr-defined]
            for m in st.modules():
                own = list(m.parameters(recurse=False))
                if own and not list(m.children()) and not any(is_sharded(p) for p in own):
                    m.register_forward_pre_hook(self._enter)
                    m.register_forward_hook(self._leave)

    def _enter(self, m: nn.Module, args: tuple) -> None:
        self._at[id(m)] = self.meter.live

    def _leave(self, m: nn.Module, args: tuple, out: object) -> None:
        self.saved += self.meter.live - self._at.pop(id(m))


def _block(trainer: object, tally: RegionTally, first: int, steps: int) -> dict:
    p2p = trainer.p2p  # type: ignore[attr-defined]
    sent0, saved0, c0 = sum(s.sent_bytes for s in p2p.stats.values()), tally.saved, time.process_time()
    recs = [trainer.step(s) for s in range(first, first + steps)]  # type: ignore[attr-defined]
    return {
        "times": [r["step_time_s"] for r in recs],
        "peak": max(r["activation_peak_bytes"] for r in recs),
        "region": (tally.saved - saved0) / steps,
        "p2p": (sum(s.sent_bytes for s in p2p.stats.values()) - sent0) / steps,
        "cpu": (time.process_time() - c0) / steps,
    }


def _worker(cfg_dict: dict, rounds: int, steps: int, compare: str = "sp") -> dict:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfgs = {m: Config.from_dict(cfg_dict) for m in MODES}
    cfgs["on"].parallel.sequence_parallel = True
    if compare == "sp_backward":  # both with sequence parallelism, the backward's two ways against each other
        cfgs["off"].parallel.sequence_parallel = True
        cfgs["off"].parallel.sp_backward, cfgs["on"].parallel.sp_backward = "saved", "regather"
    if compare == "rebuild":  # both with sequence parallelism, without and with rebuilding saved tensors
        cfgs["off"].parallel.sequence_parallel = True
        cfgs["off"].train.rebuild_saved, cfgs["on"].train.rebuild_saved = False, True
    p = cfgs["off"].parallel
    topo = build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s)
    trainers = {m: Trainer(cfgs[m], topo) for m in MODES}
    tallies = {m: RegionTally(trainers[m]) for m in MODES}
    blocks: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(rounds + 1):
        for m in MODES if r % 2 == 0 else MODES[::-1]:
            b = _block(trainers[m], tallies[m], r * steps, steps)
            if r > 0:
                blocks[m].append(b)
    return {m: blocks[m] for m in MODES}


def summarize(ranks: list[dict]) -> dict:
    """Per mode the figures over ranks and rounds, and each of them on over off."""
    out: dict = {"modes": {}}
    for m in MODES:
        bl = [b for r in ranks for b in r[m]]
        out["modes"][m] = {
            "region_saved_bytes_per_step": max(b["region"] for b in bl),
            "activation_peak_bytes": max(b["peak"] for b in bl),
            "p2p_sent_bytes_per_step": max(b["p2p"] for b in bl),
            "median_step_time_s": statistics.median(t for b in ranks[0][m] for t in b["times"]),
            "cpu_s_per_step": sum(statistics.median(b["cpu"] for b in r[m]) for r in ranks),
        }
    on, off = out["modes"]["on"], out["modes"]["off"]
    ratios = [
        statistics.median(a["times"]) / statistics.median(b["times"]) for a, b in zip(ranks[0]["on"], ranks[0]["off"])
    ]
    out["on_vs_off"] = {
        "region_saved_bytes": on["region_saved_bytes_per_step"] / off["region_saved_bytes_per_step"],
        "activation_peak": on["activation_peak_bytes"] / off["activation_peak_bytes"],
        "p2p_bytes": on["p2p_sent_bytes_per_step"] / off["p2p_sent_bytes_per_step"]
        if off["p2p_sent_bytes_per_step"]
        else None,
        "step_time": statistics.median(ratios),
        "step_time_spread": [min(ratios), max(ratios)],
        "cpu_time": on["cpu_s_per_step"] / off["cpu_s_per_step"],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench sequence_parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="llama", choices=("llama", "gpt2"))
    ap.add_argument("--layout", default="2x2x1", help="TPxPPxDP, tp >= 2")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds (one block per trainer each)")
    ap.add_argument("--steps", type=int, default=2, help="steps per block")
    ap.add_argument(
        "--compare", default="sp", choices=COMPARE, help="off/on: SP, its backward, or rebuilding saved tensors"
    )
    ap.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (fewer: grouped-query)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--json", default=None, help="also write the record to FILE")
    a = ap.parse_args(argv)
    cfg = layout_config(a.layout)
    p = cfg.parallel
    cfg.model.family, cfg.model.n_kv_heads, cfg.train.precision = a.family, a.kv_heads, a.precision
    if a.family == "gpt2":
        cfg.model.n_kv_heads, cfg.model.n_positions = None, max(a.seq_len, 1024)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.val_every, cfg.train.monitor_every = (
        a.seq_len,
        a.global_batch,
        0,
        0,
    )
    cfg.train.microbatches = min(cfg.train.microbatches, a.global_batch)
    cfg.parallel.sequence_parallel = True  # validated as it will run: tp >= 2 and seq_len split over tp
    validate_config(cfg, p.world_size)
    cfg.parallel.sequence_parallel = False
    load_before = os.getloadavg()
    ranks = run_ranks(_worker, p.world_size, cfg.to_dict(), a.rounds, a.steps, a.compare, timeout_s=3000)
    rec = {
        "compare": COMPARE[a.compare],
        "family": a.family,
        "layout": f"tp{p.tp}-pp{p.pp}-dp{p.dp}",
        "schedule": p.schedule,
        "model": f"{cfg.model.dim}d-{cfg.model.n_layers}L-ffn{cfg.model.ffn_dim}-{cfg.model.kv_heads}kv",
        "precision": a.precision,
        "seq_len": a.seq_len,
        "global_batch": a.global_batch,
        "microbatches": cfg.train.microbatches,
        "rounds": a.rounds,
        "steps_per_block": a.steps,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **summarize(ranks),
    }
    emit(rec, a.json)
    return 0
