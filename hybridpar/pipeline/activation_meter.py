"""Activation memory, measured: what the microbatch planner's budget is about.

The planner needs "bytes of activations alive at the step's peak" on every device. On CUDA the caching
allocator reports it (peak allocated minus what was resident before the step). On CPU no allocator
statistics exist and RSS barely moves (glibc keeps freed pages), so the meter counts what autograd
keeps for backward instead: every saved tensor passes through `saved_tensors_hooks`, is counted once
per storage (a tensor saved by several ops, or views of one buffer, are one allocation), parameters
excluded (they are resident anyway), and is released when the graph frees it. That is the quantity
that grows with microbatch size and microbatches in flight; transient temporaries are not in it.

Emulated device limit (testing only, `--emulate.memory_limit`): a save that would take the live bytes
past the limit raises torch.OutOfMemoryError, exactly as a CUDA allocation would, so the trainer's
out-of-memory recovery runs on CPU.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch


class _Held:
    """What autograd keeps instead of the tensor: releases the storage's bytes when autograd drops it."""

    __slots__ = ("tensor", "key", "meter", "generation")

    def __init__(self, tensor: torch.Tensor, key: int | None, meter: "ActivationMeter") -> None:
        self.tensor, self.key, self.meter, self.generation = tensor, key, meter, meter.generation

    def __del__(self) -> None:
        if self.key is not None and self.generation == self.meter.generation:
            self.meter._release(self.key)


class ActivationMeter:
    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit = limit_bytes
        self.live = 0  # bytes of distinct storages held for backward now
        self.peak = 0  # max of `live` since reset()
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [references, bytes]
        self._excluded: set[int] = set()
        self.generation = 0
        # Tensors whose storage is not theirs (a message lent in place from a transport's ring, see
        # P2P.lent): they hold only their own bytes, counted under their own address.
        self.lent: Callable[[torch.Tensor], bool] | None = None
        # Tensors in a message buffer of the rank's own (P2P.holds): a stage reading a received message in
        # place saves the buffer itself, whose bytes the rank's buffers count (trainer/held.py): not again here.
        self.buffered: Callable[[torch.Tensor], bool] | None = None

    def clear(self) -> None:
        """Forget everything held (after a failed step: its graph may linger in a traceback; whatever
        it still holds is not this meter's concern any more, and must not be released twice)."""
        self.generation += 1
        self._storages.clear()
        self.live = self.peak = 0

    def reset(self, params: Iterable[torch.Tensor] = ()) -> None:
        """Start a step: the peak restarts from what is live; `params`' storages are never counted."""
        self.peak = self.live
        self._excluded = {p.untyped_storage().data_ptr() for p in params}

    def exclude(self, p: torch.Tensor) -> None:
        """Never count `p`'s storage from now on: a ZeRO-3 parameter just gathered (dataparallel/zero3.py),
        whose storage is new since `reset`."""
        self._excluded.add(p.untyped_storage().data_ptr())

    def include(self, p: torch.Tensor) -> None:
        """`p`'s storage is about to be freed (ZeRO-3): its address may next hold an activation."""
        self._excluded.discard(p.untyped_storage().data_ptr())

    @torch.compiler.disable  # runs eagerly beside compiled layers (train.compile): Python state per tensor
    def _pack(self, t: torch.Tensor) -> _Held:
        if t.device.type == "meta" or t.layout != torch.strided:
            return _Held(t, None, self)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or key == 0 or (self.buffered is not None and self.buffered(t)):
            return _Held(t, None, self)
        lent = self.lent is not None and self.lent(t)
        if lent:
            key = t.data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            size = t.numel() * t.element_size() if lent else storage.nbytes()
            if self.limit is not None and self.live + size > self.limit:
                raise torch.OutOfMemoryError(
                    f"emulated out of memory (--emulate.memory_limit={self.limit}): holding {self.live} bytes "
                    f"of activations, {size} more requested"
                )
            self._storages[key] = [1, size]
            self.live += size
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Held(t, key, self)

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[key]

    def hold(self, t: torch.Tensor) -> _Held:
        """Count `t` as held for backward until the returned handle is dropped: for tensors kept outside
        autograd's saved tensors (a zero-bubble W's inputs and output gradients, split_backward.py)."""
        return self._pack(t)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    @contextlib.contextmanager
    def measuring(self) -> Iterator["ActivationMeter"]:
        """Count every tensor autograd saves inside the block (forward passes of the step)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
