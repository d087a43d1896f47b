"""A checkpoint directory on disk, apart from what its tensors hold (resilience/checkpoint.py writes and reads those).

Commit (`step-000123` = 123 steps done): every rank writes into a fresh `.tmp-step-000123-<nonce>` (DCP
fsyncs); barrier; rank 0 writes trainer_state.json, then manifest.json (size and sha256 of every other
file), and renames the directory: the rename is the commit. Old commits go only after a newer one exists.
Resume verifies the manifest before anything is read (accidents: torn writes, bit flips, files of another
step). Tampering it does not stop (whoever can replace a file can re-hash it), so nothing read runs code:
DCP's pickled `.metadata` goes through an allowlisting unpickler (`safe_dcp.py`), tensors through
`torch.load(weights_only=True)`. Several nodes need a shared filesystem: the ranks hash the written files in
shares (each about its own shard file) and rank 0 writes the manifest from their digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Mapping

from hybridpar.resilience.rundir import checkpoint_run_id

MANIFEST, STATE, DCP_METADATA = "manifest.json", "trainer_state.json", ".metadata"
FORMAT = "hybridpar-checkpoint/1"
_COMMITTED = re.compile(r"step-(\d{6,})")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any, indent: int | None = 1) -> None:
    with path.open("w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=indent)
        fh.flush()
        os.fsync(fh.fileno())


def _digest(ckpt: Path, f: Path, known: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    rel, size = f.relative_to(ckpt).as_posix(), f.stat().st_size
    given = known.get(rel)
    return given if given is not None and given.get("size") == size else {"size": size, "sha256": sha256(f)}


def write_manifest(
    ckpt: Path, step: int, run_id: str | None = None, known: Mapping[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Write `ckpt/manifest.json` listing size and sha256 of every other file in `ckpt` (call it last),
    and the id of the run that wrote it (see rundir.py). `known`: digests other ranks already took of
    files they wrote (`_hash_share`), used where the size still matches; the rest are hashed here."""
    files = {
        f.relative_to(ckpt).as_posix(): _digest(ckpt, f, known or {})
        for f in sorted(ckpt.rglob("*"))
        if f.is_file() and f.relative_to(ckpt).as_posix() != MANIFEST
    }
    manifest = {"format": FORMAT, "step": step, "run_id": run_id, "files": files}
    write_json(ckpt / MANIFEST, manifest)
    fsync_dir(ckpt)
    return manifest


def _read_json(path: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{path} is not valid JSON ({e})"


def verify_checkpoint(ckpt: Path, step: int | None = None) -> str | None:
    """None if `ckpt` is a complete checkpoint (of `step`, if given); otherwise why not, naming the file.
    Reads only manifest.json and trainer_state.json as JSON; every other file is only hashed."""
    ckpt = Path(ckpt)
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        return f"{mpath} is missing (never committed, or damaged)"
    m, bad = _read_json(mpath)
    if bad:
        return bad
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or m.get("format") != FORMAT or not isinstance(m.get("step"), int):
        return f"{mpath} is not a {FORMAT} manifest"
    for need in (STATE, DCP_METADATA):
        if need not in files:
            return f"{ckpt / need} is not listed in {MANIFEST}"
    for rel, meta in files.items():
        f = ckpt / rel
        if rel == MANIFEST or Path(rel).is_absolute() or ".." in Path(rel).parts or not isinstance(meta, dict):
            return f"{mpath} has an invalid entry {rel!r}"
        if f.is_symlink() or not f.is_file():
            return f"{f} is missing"
        if (size := f.stat().st_size) != meta.get("size"):
            return f"{f} has {size} bytes, {MANIFEST} says {meta.get('size')}"
        if sha256(f) != meta.get("sha256"):
            return f"{f} does not match its sha256 in {MANIFEST} (corrupted or replaced)"
    for f in sorted(ckpt.rglob("*")):
        if not f.is_dir() and f.relative_to(ckpt).as_posix() not in (*files, MANIFEST):
            return f"{f} is not listed in {MANIFEST}"
    state, bad = _read_json(ckpt / STATE)
    if bad:
        return bad
    if not isinstance(state, dict) or state.get("step") != m["step"] or (step is not None and m["step"] != step):
        return f"{ckpt / STATE} does not record step {m['step'] if step is None else step}"
    return None


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under `root`, newest first (`.tmp-*` ones never match)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _COMMITTED.fullmatch(p.name))]
    return sorted(found, reverse=True)


def find_latest(root: Path, run_id: str | None = None) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint of run `run_id` under `root` that verifies, and a reason for each
    newer one skipped (another run's checkpoints are skipped, never resumed by 'auto')."""
    skipped: list[str] = []
    for step, path in committed(root):
        theirs = checkpoint_run_id(path)
        why = (
            f"written by run {theirs}, not by this run {run_id}" if theirs != run_id else verify_checkpoint(path, step)
        )
        if why is None:
            return path, skipped
        skipped.append(f"skipped checkpoint {path.name}: {why}")
    return None, skipped


def tmp_name(step: int, run_id: str | None) -> str:
    return f".tmp-step-{step:06d}-{run_id or 'norun'}-{secrets.token_hex(6)}"


def prune(root: Path, keep: int, run_id: str | None = None) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints of run `run_id`, and leftovers of its
    interrupted saves. Another run's checkpoints and temporary directories are never touched."""
    gone = [path for _, path in committed(root) if checkpoint_run_id(path) == run_id][keep:]
    own_tmp = re.compile(rf"\.tmp-step-\d{{6,}}-{re.escape(run_id or 'norun')}-[0-9a-f]+|\.old-step-.*")
    gone += [p for p in Path(root).iterdir() if p.is_dir() and own_tmp.fullmatch(p.name)]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def commit_dir(tmp: Path, final: Path, run_id: str | None) -> None:
    old = None
    if final.exists():  # this step from an abandoned attempt: replaced, and deleted only after the commit
        mine = checkpoint_run_id(final) == run_id  # another run's is set aside, never deleted
        old = final.with_name(
            f".old-{final.name}-{secrets.token_hex(4)}" if mine else f"abandoned-{final.name}-{secrets.token_hex(4)}"
        )
        os.rename(final, old)
        old = old if mine else None
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def abandon_newer(root: Path, step: int, run_id: str | None) -> list[Path]:
    """Rename this run's committed checkpoints newer than the one resumed from out of the way
    (`abandoned-step-*`), so a later 'auto' cannot mix this run with the timeline it left. Nothing is deleted."""
    moved = []
    for s, path in committed(root):
        if s > step and checkpoint_run_id(path) == run_id:
            dest = path.with_name(f"abandoned-{path.name}-{secrets.token_hex(4)}")
            os.rename(path, dest)
            moved.append(dest)
    return moved
