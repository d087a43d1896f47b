"""hybridpar: tensor x pipeline x data parallel training of Llama-style models on PyTorch."""

from hybridpar.config import Config
from hybridpar.run.launcher import launch

__all__ = ["Config", "launch"]
