"""Reading tensors for a (possibly tensor-parallel) stage: from Hugging Face `*.safetensors` files
(each rank opens them lazily with `safe_open` and reads only its stage's tensors, and of a sharded one
only its slice) or from a full state dict in memory (a checkpoint's, or a gathered model's).

Both are `TensorSource`s: `read(name, index)` returns `tensor[index]` without reading the rest. The
family decides which parts of which file tensors make one of its parameters (model/registry.py,
`Family.read_hf`): a Llama parameter is one slice of one tensor, GPT-2's fused q/k/v projection is
three slices of a transposed one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

Index = tuple[slice, ...]


class TensorSource(Protocol):
    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        """`tensor[index]` of the tensor `name`; ValueError naming it if there is none."""
        ...

    def shape(self, name: str) -> tuple[int, ...]: ...


def shard_rows(full_len: int, rank: int, n: int) -> slice:
    """Rank `rank`'s part of a dimension split evenly over `n` ranks."""
    size = full_len // n
    return slice(rank * size, (rank + 1) * size)


def read_local(src: TensorSource, name: str, tp_dim: int | None, rank: int, n: int) -> torch.Tensor:
    """This rank's slice of `name` along `tp_dim` (the whole tensor for a replicated parameter)."""
    if tp_dim is None:
        return src.read(name)
    full = src.shape(name)[tp_dim]
    return src.read(name, (slice(None),) * tp_dim + (shard_rows(full, rank, n),))


class SafetensorsDir:
    """Lazy reader of a checkpoint directory's `*.safetensors` files: which file holds which tensor
    comes from the files' headers; data is read on request, only the part asked for."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path} holds no *.safetensors file")
        self._open = {}
        for f in files:
            try:
                self._open[f] = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # SafetensorError: truncated or not a safetensors file at all
                raise ValueError(f"{f} cannot be read as safetensors ({e}): a truncated or damaged file?") from None
        self.where = {k: f for f, h in self._open.items() for k in h.keys()}

    def _slice(self, name: str) -> Any:  # safetensors' PySafeSlice
        if name not in self.where:
            raise ValueError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return self._open[self.where[name]].get_slice(name)

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        sl = self._slice(name)
        return sl[index] if index else sl[:]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())


class StateSource:
    """A TensorSource over an in-memory full state dict."""

    def __init__(self, state: dict[str, torch.Tensor], what: str = "the state dict") -> None:
        self.state, self.what = state, what

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"tensor {name!r} is missing from {self.what}")
        return self.state[name]

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        return self._get(name)[index]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._get(name).shape)
