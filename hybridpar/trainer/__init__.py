"""One training process: bundles built per parallel dimension (build.py) and the step that runs them (step.py)."""

from hybridpar.trainer.build import layer_partition
from hybridpar.trainer.step import Trainer

__all__ = ["Trainer", "layer_partition"]
