"""Read torch.distributed.checkpoint (DCP) checkpoints without running code from them.

DCP stores a checkpoint's index, `.metadata`, as a pickle (torch/distributed/checkpoint/filesystem.py,
`_FileSystemWriter.finish`: `pickle.dump(metadata, ...)`), and its `FileSystemReader.read_metadata` reads
it back with `pickle.load`: whoever can write that file runs code in every process that loads the
checkpoint, and the manifest's sha256 cannot stop it (anyone who can replace the file can re-hash it).
Here the metadata goes through `MetadataUnpickler`, which builds only the objects DCP's Metadata is made
of and refuses everything else by name; `SafeFileSystemReader` uses it, then checks what the loaded
metadata would make DCP do. Tensors themselves DCP reads with `torch.load(weights_only=True)`
(`FileSystemReader.read_data`), torch's own restricted unpickler.

The allowlist is what DCP's `pickle.dump` writes, found by saving hybridpar checkpoints (plain, dp=2,
tp=2 DTensor shards, tp2×pp2) with torch 2.13 and recording every global their `.metadata` references:
the dataclasses of torch/distributed/checkpoint/metadata.py (Metadata, TensorStorageMetadata,
ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta, and the `_MEM_FORMAT_ENCODING` enum
TensorProperties stores in place of a memory format), `_StorageInfo` of filesystem.py, `torch.Size`,
dtypes as `torch.<name>`, `torch.serialization._get_layout` (how torch.layout pickles, registered there
with copyreg) and `pathlib.PosixPath` (StorageMeta.checkpoint_id). BytesStorageMetadata is admitted so
the file can be read and named, but `SafeFileSystemReader` refuses checkpoints that hold such entries.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.serialization import _get_layout

# Classes whose instances a pickle may fill in (BUILD): DCP's dataclasses, nothing else.
_BUILDABLE: tuple[type, ...] = (
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    StorageMeta,
    _StorageInfo,
)
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__qualname__): c for c in (*_BUILDABLE, _MEM_FORMAT_ENCODING)},
    ("torch", "Size"): torch.Size,
    # torch.layout pickles as `_get_layout("torch.strided")` (torch/serialization.py, copyreg.pickle):
    # a lookup in a table of torch's layouts that raises KeyError for anything else.
    ("torch.serialization", "_get_layout"): _get_layout,
    # PosixPath's module is `pathlib` up to Python 3.12, `pathlib._local` from 3.13 on.
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,
}
# torch.float32 and its kind pickle as the global `torch.float32`.
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something that reading it would execute or that hybridpar never writes."""


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata, admitting only the globals in `_ALLOWED` and torch's dtype-like values.

    The pure-Python unpickler (`pickle._Unpickler`, the reference implementation of `pickle.Unpickler`)
    because its opcodes are a table we can override: the C one applies BUILD to any object, a class
    included, and BUILD's slot state is `setattr(obj, name, value)`, so a pickle holding only allowlisted
    globals could still rewrite attributes of DCP's classes for the rest of the process. Every other way
    a pickle calls something (REDUCE, NEWOBJ, NEWOBJ_EX, INST, OBJ, EXT*) takes its callable from
    `find_class`."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch":
            # vars(), not getattr(): torch's module __getattr__ imports submodules on demand.
            value = vars(torch).get(name)
            found = value if isinstance(value, _TORCH_VALUE_TYPES) else None
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.source}: refused to unpickle the global {module}.{name}: DCP checkpoint metadata "
                "holds only DCP's metadata classes, torch.Size, torch dtypes/layouts and pathlib.PosixPath "
                "(the file was replaced or was not written by torch.distributed.checkpoint)"
            )
        return found

    def _load_build(self) -> None:
        target = self.stack[-2]  # under the state that BUILD pops (pickle.py, load_build)
        if type(target) not in _BUILDABLE:
            raise UnsafeCheckpointError(
                f"{self.source}: refused to set the state of {type(target).__module__}."
                f"{type(target).__qualname__} {target!r:.60}: DCP metadata sets state only on instances of "
                "its own dataclasses"
            )
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def load_metadata(path: Path) -> Metadata:
    """DCP's Metadata from the pickle at `path`, without running code from it (UnsafeCheckpointError if
    the file references anything else, or is not a Metadata)."""
    with Path(path).open("rb") as fh:
        try:
            md = MetadataUnpickler(fh, str(path)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # truncated or garbled, or an allowlisted callable given bad arguments
            raise UnsafeCheckpointError(f"{path} is not DCP checkpoint metadata ({type(e).__name__}: {e})") from e
    if type(md) is not Metadata:
        raise UnsafeCheckpointError(f"{path} holds a {type(md).__name__}, not DCP's Metadata")
    return md


def check_metadata(md: Metadata, source: str) -> None:
    """Refuse metadata that would make DCP read pickled objects or files outside the checkpoint."""
    entries, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{source}: state_dict_metadata and storage_data must be dicts")
    if not isinstance(getattr(md, "storage_meta", None), (StorageMeta, type(None))):
        raise UnsafeCheckpointError(f"{source}: storage_meta is a {type(md.storage_meta).__name__}, not a StorageMeta")
    for key, entry in entries.items():
        # DCP loads a byte entry with torch.load(weights_only=False) (default_planner.py,
        # DefaultLoadPlanner.load_bytes): arbitrary code, whatever the metadata's own pickle held.
        if type(entry) is not TensorStorageMetadata:
            raise UnsafeCheckpointError(
                f"{source}: entry {key!r} is a {type(entry).__name__}; hybridpar checkpoints hold tensors only "
                "(TensorStorageMetadata), and DCP would unpickle any other entry with torch.load(weights_only=False)"
            )
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        # FileSystemReader.read_data opens path / relative_path: a bare file name keeps every read inside
        # the directory the manifest verified.
        if (
            type(index) is not MetadataIndex
            or type(info) is not _StorageInfo
            or not isinstance(rel, str)
            or rel in ("", ".", "..")
            or Path(rel).name != rel
            or "\\" in rel
        ):
            raise UnsafeCheckpointError(
                f"{source}: storage entry {index!r:.80} -> {info!r:.80} is not a file "
                "of this checkpoint (a bare file name in _StorageInfo)"
            )


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with `read_metadata` through `MetadataUnpickler` and `check_metadata`.
    `refused` keeps the first refusal: DCP reports a failed read_metadata only as text inside its own
    errors (state_dict_loader.py `_load_state_dict`), so `load` re-raises this one."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(str(path))
        self.refused: UnsafeCheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # As FileSystemReader.read_metadata (torch/distributed/checkpoint/filesystem.py): the global
        # `.metadata`, or `__<rank>.metadata` when DCP asks for a rank's own; then a StorageMeta carrying
        # this load's id. The reader's storage_data is set from the metadata by set_up_storage_reader.
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            md = load_metadata(path)
            check_metadata(md, str(path))
        except UnsafeCheckpointError as e:
            self.refused = self.refused or e
            raise
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def load(state: dict[str, torch.Tensor], path: str | Path, *, no_dist: bool = False) -> None:
    """`dcp.load(state)` from the checkpoint directory `path` through SafeFileSystemReader; a refused
    metadata file raises UnsafeCheckpointError naming the file and what it held (on every rank)."""
    reader = SafeFileSystemReader(path)
    try:
        dcp.load(state, storage_reader=reader, no_dist=no_dist)
    except (Exception, CheckpointException):  # DCP's collective errors derive from BaseException (api.py)
        if reader.refused is not None:
            raise reader.refused from None
        raise
