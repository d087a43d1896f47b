"""Which fast paths a training run takes, in its log and metrics: the attention kernel that
scaled_dot_product_attention dispatches to (fused flash/memory-efficient, or the unfused math path), and
under train.compile the graphs compiled so far (first compiles, graph-break fragments, recompiles)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from hybridpar.model.kvcache import attention_kernel

if TYPE_CHECKING:
    from hybridpar.trainer.step import Trainer


class FastPathsDuty:
    """Logs the attention kernel before the first step; with train.compile, `compiled_graphs` in each step's
    record and a log line whenever it grows (a recompile after step 0 is news: a shape changed) and the
    totals at the end."""

    def __init__(self, trainer: Trainer, logger: logging.Logger, rank0: bool) -> None:
        self.trainer, self.logger, self.rank0 = trainer, logger, rank0
        self.compiled = trainer.mp.compiled
        self.seen = 0  # graphs already logged
        self.told = False  # the attention kernel logged

    def begin(self, step: int) -> None:
        if self.told or not self.rank0:
            return
        self.told = True
        m, t, p = self.trainer.cfg.model, self.trainer.cfg.train, self.trainer.cfg.parallel
        dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
        device = self.trainer.topo.device
        kernel = attention_kernel(m.n_heads // p.tp, t.seq_len, m.head_dim, device, dtype)
        self.logger.info(
            f"attention: scaled_dot_product_attention takes the {kernel} kernel "
            f"({device.type}, {str(dtype)[6:]}, {m.n_heads // p.tp} heads x {t.seq_len} tokens x {m.head_dim})"
            + ("; document masks add an explicit mask" if self.trainer.cfg.data.document_mask else "")
        )

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        if self.compiled is None:
            return False
        rec["compiled_graphs"] = self.compiled.graphs
        if self.compiled.graphs > self.seen:
            s = self.compiled.summary()
            self.logger.info(
                f"compile: step {step}: {s['graphs']} graphs compiled so far ({s['backend']}, "
                f"{s['compile_s']} s compiling forward graphs)"
            )
            self.seen = self.compiled.graphs
        return False

    def finish(self) -> None:
        pass
