"""No checkpoint file can run code: DCP's pickled `.metadata` goes through an allowlisting unpickler.

Unit: real metadata written by our save path (tp-sharded DTensors and plain) loads exactly as pickle
would load it, and pickles that call os.system, exec, subprocess or a torch function are refused by
name. Attack: a checkpoint whose `.metadata` is replaced by a pickle that would create a marker file,
re-hashed into manifest.json so that verification passes, is refused when training resumes (through
the real launcher) and when serving loads it; the marker never appears.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from hybridpar.resilience.checkpoint import read_full_model
from hybridpar.resilience.commits import DCP_METADATA, MANIFEST, committed, verify_checkpoint
from hybridpar.resilience.safe_dcp import MetadataUnpickler, SafeFileSystemReader, UnsafeCheckpointError, load_metadata
from hybridpar.run.launcher import launch

sys.path.insert(0, str(Path(__file__).parent))
from test_equivalence import tiny_config  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2, pp=1, dp=1), "plain": dict(tp=1, pp=1, dp=1)}


def _cfg(run_dir: Path, layout: str, steps: int = 2, resume: str = "off") -> Any:
    cfg = tiny_config(
        train=dict(steps=steps, val_every=0, monitor_every=0),
        parallel=dict(schedule="1f1b", timeout_s=30.0, **LAYOUTS[layout]),
        checkpoint=dict(every=1, resume=resume),
    )
    cfg.run_dir = str(run_dir)
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A run directory per layout, two steps, a checkpoint after each, written by the real launcher."""
    out = {}
    for name in LAYOUTS:
        d = tmp_path_factory.mktemp(name) / "run"
        assert launch(_cfg(d, name), max_restarts=0)["params_digest"]
        out[name] = d
    return out


def _newest(run: Path) -> Path:
    return committed(run / "checkpoints")[0][1]


class _Call:
    """Pickles as `fn(*args)`: what a malicious `.metadata` runs when pickle.load reads it."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _bombs(marker: Path) -> dict[str, tuple[bytes, str]]:
    """Pickles that would create `marker` (or call a torch function), and the global each must be refused as."""
    touch = f"touch {marker}"
    return {
        "os.system, protocol 0": (b"cos\nsystem\n(S'" + touch.encode() + b"'\ntR.", "os.system"),
        "os.system": (pickle.dumps(_Call(os.system, touch)), f"{os.system.__module__}.system"),
        "exec": (pickle.dumps(_Call(exec, f"open({str(marker)!r}, 'w')")), "builtins.exec"),
        "subprocess": (pickle.dumps(_Call(subprocess.call, ["touch", str(marker)])), "subprocess.call"),
        "torch.save": (pickle.dumps(_Call(torch.save, {}, str(marker))), "torch.serialization.save"),
        "torch.<name> not a dtype": (b"ctorch\nsave\n(}S'" + str(marker).encode() + b"'\ntR.", "torch.save"),
        # inside a genuine Metadata: refused wherever it sits
        "nested": (pickle.dumps(Metadata(state_dict_metadata={"w": _Call(os.system, touch)})), ".system"),
    }


def _replace_metadata(ckpt: Path, data: bytes) -> None:
    """Swap `.metadata` and re-hash it into manifest.json (size and sha256, as write_manifest records
    them): verification then passes, as it would for anyone able to write the directory."""
    (ckpt / DCP_METADATA).write_bytes(data)
    m = json.loads((ckpt / MANIFEST).read_text())
    m["files"][DCP_METADATA] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(m, indent=1))
    assert verify_checkpoint(ckpt) is None


# ---- unit: the unpickler on real metadata and on malicious pickles -----------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_real_metadata_loads_as_pickle_would(runs: dict[str, Path], layout: str) -> None:
    ckpt = _newest(runs[layout])
    md = load_metadata(ckpt / DCP_METADATA)
    with (ckpt / DCP_METADATA).open("rb") as fh:
        assert md == pickle.load(fh)  # our own freshly written file: safe to compare against
    chunks = [len(m.chunks) for m in md.state_dict_metadata.values()]
    assert max(chunks) == (2 if layout == "tp2" else 1)  # tp shards are DTensor chunks
    ours, theirs = SafeFileSystemReader(ckpt).read_metadata(), FileSystemReader(str(ckpt)).read_metadata()
    assert ours.storage_meta.load_id and ours.storage_meta.load_id != theirs.storage_meta.load_id
    ours.storage_meta.load_id = theirs.storage_meta.load_id
    assert ours == theirs


@pytest.mark.parametrize("kind", list(_bombs(Path("x"))))
def test_malicious_pickles_are_refused_by_name(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "PWNED"
    data, found = _bombs(marker)[kind]
    f = tmp_path / DCP_METADATA
    f.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle the global") as e:
        load_metadata(f)
    assert str(f) in str(e.value) and found in str(e.value)
    assert "holds only DCP's metadata classes" in str(e.value)
    assert not marker.exists()


def test_globals_admitted_are_values_not_lookups() -> None:
    u = MetadataUnpickler(io.BytesIO(b""), "test")
    assert u.find_class("torch", "float32") is torch.float32 and u.find_class("torch", "strided") is torch.strided
    assert u.find_class("torch", "contiguous_format") is torch.contiguous_format
    for module, name in [
        ("torch", "_C"),
        ("torch", "float32.__class__"),
        ("torch", "load"),
        ("torch", "ops"),
        ("builtins", "getattr"),
        ("collections", "OrderedDict"),
        ("torch._utils", "_rebuild_tensor_v2"),
    ]:
        with pytest.raises(UnsafeCheckpointError, match=re.escape(f"global {module}.{name}:")):
            u.find_class(module, name)


def test_build_on_a_class_is_refused(tmp_path: Path) -> None:
    # GLOBAL Metadata; BUILD (None, {"__doc__": "pwned"}): the C unpickler would setattr on the class itself.
    f = tmp_path / DCP_METADATA
    f.write_bytes(b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dS'__doc__'\nS'pwned'\nstb.")
    doc = Metadata.__doc__
    with pytest.raises(UnsafeCheckpointError, match="refused to set the state of builtins.type"):
        load_metadata(f)
    assert Metadata.__doc__ == doc


@pytest.mark.parametrize(
    "change,expect",
    [
        (lambda md: md.state_dict_metadata.update(w=BytesStorageMetadata()), "entry 'w' is a BytesStorageMetadata"),
        (
            lambda md: setattr(next(iter(md.storage_data.values())), "relative_path", "../outside.distcp"),
            "is not a file of this checkpoint",
        ),
        (lambda md: setattr(md, "storage_data", None), "storage_data must be dicts"),
        (lambda md: setattr(md, "storage_meta", 3), "storage_meta is a int, not a StorageMeta"),
    ],
)
def test_metadata_that_would_read_pickles_or_other_files_is_refused(
    runs: dict[str, Path], tmp_path: Path, change: Any, expect: str
) -> None:
    ckpt = shutil.copytree(_newest(runs["plain"]), tmp_path / "ck")
    with (ckpt / DCP_METADATA).open("rb") as fh:
        md = pickle.load(fh)
    change(md)
    (ckpt / DCP_METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match=expect):
        SafeFileSystemReader(ckpt).read_metadata()


def test_not_metadata_is_refused(tmp_path: Path) -> None:
    f = tmp_path / DCP_METADATA
    for data, expect in [
        (pickle.dumps({"state_dict_metadata": {}}), "holds a dict, not DCP's Metadata"),
        (b"\x80\x04garbage", "is not DCP checkpoint metadata"),
    ]:
        f.write_bytes(data)
        with pytest.raises(UnsafeCheckpointError, match=expect):
            load_metadata(f)


# ---- the attack, end to end: training resumes, serving loads ---------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_resume_refuses_a_rehashed_malicious_metadata(
    runs: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = shutil.copytree(runs["tp2"], tmp_path / "run")
    marker = tmp_path / "PWNED"
    data, found = _bombs(marker)["os.system, protocol 0"]
    _replace_metadata(_newest(run), data)
    capfd.readouterr()
    with pytest.raises(Exception):  # every attempt (first start and any restart) refuses the checkpoint
        launch(_cfg(run, "tp2", steps=3, resume="auto"), max_restarts=1)
    err = capfd.readouterr().err
    assert not marker.exists()
    assert f"{_newest(run) / DCP_METADATA}: refused to unpickle the global {found}" in err, err[-3000:]


@pytest.mark.timeout(120)
def test_serving_refuses_a_rehashed_malicious_metadata(runs: dict[str, Path], tmp_path: Path) -> None:
    from hybridpar.serve.worker import WorkerSpec, build_serving_stage, resolve_source
    from tests.replica import local_topology

    ckpt = shutil.copytree(_newest(runs["tp2"]), tmp_path / "ck")
    marker = tmp_path / "PWNED"
    source, model = resolve_source(str(ckpt), None)  # as `hybridpar serve --source <checkpoint dir>`
    spec = WorkerSpec(model=asdict(model), source=source)
    build_serving_stage(spec, local_topology())  # the untouched checkpoint serves
    for kind, (data, found) in _bombs(marker).items():
        _replace_metadata(ckpt, data)
        for load in (lambda: build_serving_stage(spec, local_topology()), lambda: read_full_model(ckpt, model)):
            with pytest.raises(BaseException) as e:  # DCP's own errors derive from BaseException
                load()
            assert not marker.exists(), kind
            assert isinstance(e.value, UnsafeCheckpointError), e.value
            assert f"{ckpt / DCP_METADATA}: refused to unpickle the global" in str(e.value) and found in str(e.value)
