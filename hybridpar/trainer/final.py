"""The end of a finished run, as the training loop's last duty (trainer/duty.py): the full model gathered
onto rank 0 and its digest; then on rank 0 the final record of `metrics.jsonl`, the model as a Hugging
Face directory (`final/`), the run marked finished in run.json, and in the log where the model is, the
microbatching summary and a sample from the model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridpar.config import Config
from hybridpar.data.corpus import decode, encode
from hybridpar.data.tokenizer import Tokenizer
from hybridpar.dataparallel.copies import MasterAdamW
from hybridpar.model.hf import StateSource
from hybridpar.model.registry import empty_stage, load_stage_
from hybridpar.model.stage import generate
from hybridpar.resilience import rundir
from hybridpar.resilience.session import Session, ledger_stats
from hybridpar.trainer.export import FINAL_DIR, gather_full_state, params_digest, write_model_dir

if TYPE_CHECKING:
    from hybridpar.report.metrics import MetricsDuty
    from hybridpar.trainer.step import Trainer


def summary_line(stats: dict, oom_retries: int) -> str:
    """End-of-run microbatching summary (the full statistics are in the final metrics record)."""
    thr = stats["mean_throughput"]
    # The policy measures the pipeline's run only (what a split changes), and averages each step's tokens/s:
    # both said, since neither is metrics.jsonl's step_time_s nor total tokens / total time (a slow first
    # step, such as train.compile's, weighs on the mean time and hardly on the mean rate).
    line = f"microbatching: {stats['policy']}, split {stats['current_split']}" + (
        f"; the pipeline (optimizer step excluded): mean {stats['mean_latency_s']:.3f} s/step, mean of each "
        f"step's {thr:,.0f} tok/s"
        if thr
        else ""
    )
    if stats["policy"] == "adaptive":
        done = stats["steps_to_converge"]
        line += f"; {len(stats['history'])} splits measured, " + (
            f"converged after {done} steps" if done is not None else "still exploring"
        )
    return line + (f"; {oom_retries} step(s) redone after running out of memory" if oom_retries else "")


def sample_text(cfg: Config, state: dict[str, torch.Tensor]) -> str:
    """train.sample_tokens generated on the CPU from the full model after train.sample_prompt, framed for
    the log."""
    t = cfg.train
    model = empty_stage(cfg.model, range(cfg.model.n_layers), True, True, torch.device("cpu"))
    load_stage_(model, StateSource(state), hf_layout=False)
    tok = Tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    prompt = tok.encode(t.sample_prompt) if tok else encode(t.sample_prompt)
    out = generate(model, prompt, t.sample_tokens, seed=t.seed)
    text = tok.decode(out) if tok else decode(out)
    return f"\n--- sample from the trained model ---\n{t.sample_prompt}{text}\n---"


class FinalModelDuty:
    """Collective at `finish` (the gather). `metrics`: rank 0's metrics file (None on the other ranks);
    `sample`: whether to generate the sample (a test's quiet run skips the generation's cost). Afterwards
    rank 0 holds the full model in `state` and its digest in `digest`."""

    def __init__(
        self,
        trainer: Trainer,
        session: Session,
        token: str,
        logger: logging.Logger,
        metrics: MetricsDuty | None,
        sample: bool,
    ) -> None:
        self.trainer, self.session, self.token, self.logger = trainer, session, token, logger
        self.metrics, self.sample = metrics, sample
        self.state: dict[str, torch.Tensor] | None = None
        self.digest: str | None = None

    def begin(self, step: int) -> None:
        pass

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        return False

    def final_record(self) -> dict[str, Any]:
        tr, steps = self.trainer, self.trainer.cfg.train.steps
        return {
            "final": True,
            "run_id": self.session.run_id,
            "params_digest": self.digest,
            "steps": steps,
            "samples_applied": self.session.applied,
            "ledger": ledger_stats(self.session.applied, steps, tr.cfg.train.global_batch),  # for hybridpar report
            "batching": tr.policy.statistics(),
            "oom_retries": tr.oom_retries,
            "p2p": {str(k): v.to_dict() for k, v in tr.p2p.stats.items()},
        }

    def finish(self) -> None:
        tr, cfg = self.trainer, self.trainer.cfg
        if tr.zero3 is not None:  # the export gathers once, at the end (collective over dp)
            tr.zero3.close()
            tr.zero3 = None
        if isinstance(tr.opt, MasterAdamW):  # bf16 working copies: the model is the fp32 masters (collective)
            tr.opt.widen()
        state = gather_full_state(tr.topo, tr.stages, tr.parts, cfg.model, tr.stage_ranks)
        if tr.topo.rank != 0:
            return
        self.state, self.digest = state, params_digest(state.items())
        self.metrics.end(self.final_record())
        run_dir, steps = Path(cfg.run_dir), cfg.train.steps
        record = {"run_id": self.session.run_id, "step": steps, "params_digest": self.digest}
        final = write_model_dir(state, cfg.model, run_dir / FINAL_DIR, record, cfg.data.tokenizer)
        rundir.record_state(run_dir, self.token, state="finished", step=steps)
        self.logger.info(f"hybridpar: the trained model is in {final} (a Hugging Face model directory)")
        self.logger.info(summary_line(tr.policy.statistics(), tr.oom_retries))
        if self.sample and cfg.train.sample_tokens:
            self.logger.info(sample_text(cfg, state))
