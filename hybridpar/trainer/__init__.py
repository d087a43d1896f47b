"""One training process: bundles built per parallel dimension (build.py), the step that runs them (step.py)
and the duties the training loop runs around it (duty.py, final.py)."""

from hybridpar.trainer.build import layer_partition
from hybridpar.trainer.step import Trainer

__all__ = ["Trainer", "layer_partition"]
