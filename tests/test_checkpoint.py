"""Checkpoints and resume: manifest write/verify and directory selection (pure), config, and multi-process
runs where a run killed after a checkpoint and resumed trains bit for bit the model of an uninterrupted run,
corrupt or uncommitted checkpoints are skipped, and `keep` prunes."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest

from hybridpar.config import Config, parse_args
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.resilience.checkpoint import read_full_model
from hybridpar.resilience.commits import (
    MANIFEST,
    STATE,
    commit_dir,
    committed,
    find_latest,
    prune,
    verify_checkpoint,
    write_manifest,
)
from hybridpar.topology.spawn import run_ranks
from hybridpar.trainer.export import params_digest

sys.path.insert(0, str(Path(__file__).parent))
from test_equivalence import final_state, tiny_config  # noqa: E402

# ---- pure: manifest, verification, selection -------------------------------------------------------------------


def fake_checkpoint(root: Path, step: int, run_id: str | None = None) -> Path:
    """A committed-looking directory with DCP-like files (no torch.distributed needed)."""
    d = root / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"metadata" * 64)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (d / STATE).write_text(json.dumps({"step": step, "run_id": run_id}))
    write_manifest(d, step, run_id)
    return d


def test_manifest_round_trip(tmp_path: Path) -> None:
    d = fake_checkpoint(tmp_path, 3)
    m = json.loads((d / MANIFEST).read_text())
    assert sorted(m["files"]) == [".metadata", "__0_0.distcp", STATE] and m["step"] == 3
    assert m["files"]["__0_0.distcp"]["size"] == 1024
    assert verify_checkpoint(d) is None and verify_checkpoint(d, 3) is None
    assert "does not record step 4" in verify_checkpoint(d, 4)


def _flip(f: Path) -> None:
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))


@pytest.mark.parametrize(
    "damage,expect",
    [
        (lambda d: _flip(d / "__0_0.distcp"), r"__0_0\.distcp does not match its sha256"),
        (
            lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100]),
            r"__0_0\.distcp has 100 bytes, manifest.json says 1024",
        ),
        (lambda d: (d / MANIFEST).unlink(), r"manifest\.json is missing"),
        (lambda d: (d / "__0_0.distcp").unlink(), r"__0_0\.distcp is missing"),
        (lambda d: (d / "evil.pt").write_bytes(b"x"), r"evil\.pt is not listed in manifest\.json"),
        (lambda d: (d / MANIFEST).write_text("{not json"), r"manifest\.json is not valid JSON"),
        (
            lambda d: (d / MANIFEST).write_text(json.dumps({"format": "x", "files": {}, "step": 1})),
            r"is not a hybridpar-checkpoint/1 manifest",
        ),
    ],
)
def test_damage_is_detected_and_named(tmp_path: Path, damage, expect: str) -> None:
    d = fake_checkpoint(tmp_path, 2)
    damage(d)
    assert re.search(expect, verify_checkpoint(d) or ""), verify_checkpoint(d)


def test_unsafe_or_inconsistent_manifest(tmp_path: Path) -> None:
    d = fake_checkpoint(tmp_path, 2)
    m = json.loads((d / MANIFEST).read_text())
    m["files"]["../outside"] = {"size": 1, "sha256": "0"}
    (d / MANIFEST).write_text(json.dumps(m))
    assert "invalid entry '../outside'" in verify_checkpoint(d)
    d = fake_checkpoint(tmp_path / "b", 2)
    (d / STATE).write_text(json.dumps({"step": 5}))  # a consistent manifest over a wrong trainer state
    write_manifest(d, 2)
    assert "does not record step 2" in verify_checkpoint(d)


def test_malicious_pickle_is_rejected_unread(tmp_path: Path) -> None:
    class Boom:
        def __reduce__(self):
            return (open, (str(tmp_path / "PWNED"), "w"))

    d = fake_checkpoint(tmp_path, 2)
    bomb = pickle.dumps(Boom())  # what DCP would unpickle on load, padded to the size of the real one
    (d / ".metadata").write_bytes(bomb.ljust((d / ".metadata").stat().st_size, b" "))
    assert ".metadata does not match its sha256" in verify_checkpoint(d)
    assert not (tmp_path / "PWNED").exists()
    with pytest.raises(ValueError, match="cannot be used"):
        read_full_model(d, Config().model)
    assert not (tmp_path / "PWNED").exists()


def test_find_latest_skips_bad_and_uncommitted(tmp_path: Path) -> None:
    assert find_latest(tmp_path / "none") == (None, [])
    fake_checkpoint(tmp_path, 2)
    _flip(fake_checkpoint(tmp_path, 4) / "__0_0.distcp")
    shutil.copytree(fake_checkpoint(tmp_path / "x", 6), tmp_path / ".tmp-step-000006-abc")  # valid but uncommitted
    shutil.copytree(tmp_path / "x" / "step-000006", tmp_path / "abandoned-step-000006-ab")
    (tmp_path / "step-000008").mkdir()  # a commit that lost its manifest
    assert [s for s, _ in committed(tmp_path)] == [8, 4, 2]
    path, skipped = find_latest(tmp_path)
    assert path == tmp_path / "step-000002"
    assert len(skipped) == 2 and "step-000008" in skipped[0] and "manifest.json is missing" in skipped[0]
    assert "step-000004" in skipped[1] and "__0_0.distcp does not match" in skipped[1]


def test_prune_keeps_newest_and_clears_leftovers(tmp_path: Path) -> None:
    for s in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, s, "aaaa")
    (tmp_path / ".tmp-step-000010-aaaa-ff").mkdir()
    prune(tmp_path, 2, "aaaa")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006", "step-000008"]


def test_prune_and_latest_touch_only_their_own_run(tmp_path: Path) -> None:
    """Another run's checkpoints (newer ones too) and its interrupted saves are neither counted, deleted nor
    resumed: the defect was a fresh run pruning its own checkpoints for the old run's higher steps."""
    for s in (2, 4, 6):
        fake_checkpoint(tmp_path, s, "mine")
    for s in (10, 12):
        fake_checkpoint(tmp_path, s, "other")
    (tmp_path / ".tmp-step-000014-other-ab12").mkdir()
    (tmp_path / ".tmp-step-000008-mine-cd34").mkdir()
    prune(tmp_path, 2, "mine")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-step-000014-other-ab12",
        "step-000004",
        "step-000006",
        "step-000010",
        "step-000012",
    ]
    path, skipped = find_latest(tmp_path, "mine")
    assert path == tmp_path / "step-000006" and len(skipped) == 2
    assert all("written by run other, not by this run mine" in s for s in skipped)


def test_commit_replaces_an_existing_step(tmp_path: Path) -> None:
    old = fake_checkpoint(tmp_path, 4)
    _flip(old / "__0_0.distcp")
    new = fake_checkpoint(tmp_path / "tmp", 4)
    commit_dir(new, old, None)
    assert verify_checkpoint(old, 4) is None and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "tmp"]


def test_commit_sets_another_runs_step_aside(tmp_path: Path) -> None:
    old = fake_checkpoint(tmp_path, 4, "other")
    new = fake_checkpoint(tmp_path / "tmp", 4, "mine")
    commit_dir(new, old, "mine")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith("abandoned-step-000004-") and names[1:] == ["step-000004", "tmp"]
    assert json.loads((tmp_path / names[0] / MANIFEST).read_text())["run_id"] == "other"


# ---- config ----------------------------------------------------------------------------------------------------


def test_checkpoint_config(tmp_path: Path) -> None:
    cfg = parse_args(["--checkpoint.every", "5", "--checkpoint.resume", "auto", "--checkpoint.dir", str(tmp_path)])
    assert (cfg.checkpoint.every, cfg.checkpoint.keep, cfg.checkpoint.resume) == (5, 3, "auto")
    validate_config(cfg)
    assert parse_args(["--resume", str(tmp_path)]).checkpoint.resume == str(tmp_path)  # the short alias
    assert Config.from_dict(cfg.to_dict()).checkpoint == cfg.checkpoint
    for flags, message in [
        (["--checkpoint.every", "-1"], "checkpoint.every must be a non-negative integer"),
        (["--checkpoint.keep", "0"], "checkpoint.keep must be a positive integer"),
        (["--resume", str(tmp_path / "nope")], "checkpoint.resume='"),
        (["--checkpoint.resume", "latest"], "must be 'off', 'auto' or an existing"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            validate_config(parse_args(flags))


# ---- multi-process: kill, resume, corruption -------------------------------------------------------------------


class _Killed(Exception):
    pass


def _worker(base: dict, root: str, kill_at: int, other_layout: dict) -> dict:
    import torch.distributed as dist

    import hybridpar.resilience.checkpoint as ckpt
    from hybridpar.run.train import train
    from hybridpar.trainer import Trainer

    def run(name: str, kill: int | None = None, layout: dict | None = None, **ck) -> dict:
        cfg = Config.from_dict(base)
        cfg.run_dir = f"{root}/{name}"
        for k, v in (layout or {}).items():
            setattr(cfg.parallel, k, v)
        for k, v in {"every": 2, **ck}.items():
            setattr(cfg.checkpoint, k, v)
        step = Trainer.step

        def killing_step(self, s):
            if s == kill:  # every rank stops at the same point, as if the job had been killed here
                raise _Killed
            return step(self, s)

        Trainer.step = killing_step
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                res = train(cfg, log=False)
            return {"losses": res.losses, "digest": res.digest, "start": res.start_step, "log": out.getvalue()}
        except _Killed:
            return {"killed": True}
        except (ValueError, RuntimeError) as e:
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            Trainer.step = step

    rank0 = int(os.environ["RANK"]) == 0
    ck = Path(root, "b", "checkpoints")
    r = {"full": run("full", keep=2), "killed": run("b", kill=kill_at)}
    if rank0:  # a valid-looking later checkpoint that was never committed: must not be picked
        shutil.copytree(Path(root, "full", "checkpoints", "step-000006"), ck / ".tmp-step-000006-dead")
    dist.barrier()
    r["resumed"] = run("b", resume="auto")
    if rank0:  # now step 2, 4, 6 exist: a pickle bomb replaces step 6's DCP metadata, step 4 loses bytes
        meta = ck / "step-000006" / ".metadata"
        bomb = b"cos\nsystem\n(S'touch " + str(Path(root, "PWNED")).encode() + b"'\ntR."  # os.system on load
        meta.write_bytes(bomb.ljust(meta.stat().st_size, b" "))  # same size: only the sha256 can tell
        f = max((ck / "step-000004").glob("*.distcp"), key=lambda f: f.stat().st_size)
        f.write_bytes(f.read_bytes()[:-7])
        r["truncated"] = f.name
        r["metrics_before"] = Path(root, "b", "metrics.jsonl").read_text().count("\n")
    dist.barrier()
    r["explicit_bad"] = run("c", resume=str(ck / "step-000006"))
    r["fallback"] = run("b", resume="auto")
    # Another layout resumes the same checkpoint (DCP reshards tp shards and stages by name).
    r["reshard"] = run("g", layout=other_layout, every=0, resume=f"{root}/full/checkpoints/step-000004")
    # A save that fails on rank 0 after every rank wrote: all ranks raise, earlier commits stay intact.
    manifest = ckpt.write_manifest

    def failing_manifest(path: Path, step: int, run_id: str | None = None, known: dict | None = None) -> dict:
        if step == 4:
            raise OSError(28, "No space left on device")
        return manifest(path, step, run_id, known)

    ckpt.write_manifest = failing_manifest
    r["save_fails"] = run("e", kill=None)
    ckpt.write_manifest = manifest
    if rank0:
        r["dirs"] = sorted(p.name for p in ck.iterdir())
        r["full_dirs"] = sorted(p.name for p in Path(root, "full", "checkpoints").iterdir())
        r["e_dirs"] = sorted(p.name for p in Path(root, "e", "checkpoints").iterdir())
        r["e_ok"] = ckpt.verify_checkpoint(Path(root, "e", "checkpoints", "step-000002"), 2)
        r["metrics"] = [json.loads(x) for x in Path(root, "b", "metrics.jsonl").read_text().splitlines()]
    return r


CASES = {
    "tp2-pp2-tied-interleaved": dict(
        model=dict(tie_embeddings=True), parallel=dict(tp=2, pp=2, dp=1, schedule="interleaved-1f1b", virtual_stages=2)
    ),
    "tp2-dp2": dict(parallel=dict(tp=2, pp=1, dp=2, schedule="1f1b")),
    # GPT-2: biases (sharded and replicated), learned positions, its embedding tied across stages.
    "gpt2-tp2-pp2": dict(
        model=dict(family="gpt2", n_kv_heads=None, n_positions=24), parallel=dict(tp=2, pp=2, dp=1, schedule="zb-h1")
    ),
}
OTHER_LAYOUT = {
    "tp2-pp2-tied-interleaved": dict(tp=1, pp=2, dp=2, schedule="1f1b", virtual_stages=1),
    "tp2-dp2": dict(tp=1, pp=4, dp=1, schedule="gpipe"),
    "gpt2-tp2-pp2": dict(tp=2, pp=1, dp=2, schedule="1f1b"),
}


def _case_config(case: str) -> Config:
    """The case on 4 layers, the fewest that every layout here needs (interleaved pp2 x 2 virtual stages,
    pp4): what is claimed (bit-exact resume, damaged checkpoints skipped, resharding, pruning) does not
    depend on depth, and each layer more is more tensors to save, verify and load in each of the runs."""
    over = dict(CASES[case])
    over["model"] = dict(n_layers=4, **over.get("model", {}))
    return tiny_config(train=dict(steps=6, val_every=2), **over)


def _cases_worker(cases: list[tuple[dict, str, int, dict]]) -> list[dict]:
    """_worker for each case in turn, each in its own directory."""
    return [_worker(*case) for case in cases]


@pytest.fixture(scope="module")
def case_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Every case in one launch (all are 4 ranks): a launch costs ~5 s of interpreters importing torch
    before its first step. Each case still trains, kills, damages and resumes in a directory of its own
    from scratch, and each test reads only its own case."""
    roots = {case: tmp_path_factory.mktemp(case) for case in CASES}
    cases = [(_case_config(c).to_dict(), str(roots[c]), 5, OTHER_LAYOUT[c]) for c in CASES]
    # The three take ~45 s on 2 idle cores; pytest's 300 s (the first test's setup) bounds them too.
    results = run_ranks(_cases_worker, 4, cases, timeout_s=400)[0]
    return {c: (roots[c], r) for c, r in zip(CASES, results)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bit_exact_and_skips_bad_checkpoints(case: str, case_runs: dict) -> None:
    cfg = _case_config(case)
    tmp_path, r = case_runs[case]
    full, resumed, fallback = r["full"], r["resumed"], r["fallback"]
    assert r["killed"] == {"killed": True} and len(full["losses"]) == 6
    # Killed during step 5 (0-based): the last commit is after 4 steps; the uncommitted step 6 is ignored.
    assert resumed["start"] == 4 and "resumed from" in resumed["log"] and "step-000004" in resumed["log"]
    assert resumed["losses"] == full["losses"][4:] and resumed["digest"] == full["digest"]
    # Step 6 (bad pickle) and step 4 (truncated) are skipped by name; step 2 is used, exactly.
    log = fallback["log"]
    assert "skipped checkpoint step-000006" in log and ".metadata does not match its sha256" in log
    assert "skipped checkpoint step-000004" in log and f"{r['truncated']} has" in log
    assert fallback["start"] == 2 and fallback["losses"] == full["losses"][2:]
    assert fallback["digest"] == full["digest"]
    assert not (tmp_path / "PWNED").exists()
    assert "checkpoint.resume=" in r["explicit_bad"]["error"] and ".metadata" in r["explicit_bad"]["error"]
    # keep=2 pruned the full run to its last two; the damaged ones were set aside, not deleted.
    assert r["full_dirs"] == ["step-000004", "step-000006"]
    assert [d for d in r["dirs"] if d.startswith("step-")] == ["step-000002", "step-000004", "step-000006"]
    assert sum(d.startswith("abandoned-step-") for d in r["dirs"]) == 2
    # metrics.jsonl holds each step once: a resume cuts it back to the steps before the checkpoint (the
    # killed run's 5 steps, cut to 4 then 4, 5, final; cut to 2 by the fallback, then 2..5 and final).
    steps = [m.get("step", "final") for m in r["metrics"]]
    assert steps == [0, 1, 2, 3, 4, 5, "final"] and r["metrics_before"] == 7
    assert [m["loss"] for m in r["metrics"][2:6]] == fallback["losses"][:4]
    # Layout-independent: one process reads the sharded checkpoint into the full model, bit for bit.
    state = read_full_model(tmp_path / "full" / "checkpoints" / "step-000006", cfg.model)
    assert params_digest(state.items()) == full["digest"]
    ref = final_state(tmp_path / "full", cfg.model)
    assert list(state) == list(ref)
    _check_written_once(tmp_path / "full" / "checkpoints" / "step-000006", cfg.model.tied)
    # Resumed in another (tp, pp, dp): the same training within the exactness tolerance of every layout.
    rs = r["reshard"]
    assert rs["start"] == 4 and max(abs(a - b) for a, b in zip(rs["losses"], full["losses"][4:])) <= 1e-5
    other = final_state(tmp_path / "g", cfg.model)
    for name, t in ref.items():
        assert (other[name] - t).abs().max().item() <= 1e-5, name
    # The failed save: reported on every rank, step 2 intact, step 4 never committed.
    assert "saving the checkpoint of step 4" in r["save_fails"]["error"] and "No space left" in r["save_fails"]["error"]
    assert r["e_ok"] is None and [d for d in r["e_dirs"] if not d.startswith(".tmp-")] == ["step-000002"]


def _check_written_once(path: Path, tied: bool) -> None:
    """Every tensor's chunks tile it exactly: replicas (dp, and tp for norm gains) were written once."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    assert verify_checkpoint(path) is None  # our own, verified file: DCP's pickled metadata is safe to read
    md = FileSystemReader(str(path)).read_metadata()
    keys = md.state_dict_metadata
    assert any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in keys)
    assert ("lm_head.weight" in keys) != tied  # a tied head is the embedding: not saved twice
    for key, m in keys.items():
        assert isinstance(m, TensorStorageMetadata)
        assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), key


# ---- asynchronous saves -----------------------------------------------------------------------------------------


def _async_worker(base: dict, root: str) -> dict:
    from hybridpar.run.train import train
    from hybridpar.topology.mesh import build_topology

    out = {}
    for name, async_save, fault in [
        ("sync", False, ""),
        # the background write of step 2's checkpoint stalls while training
        # goes on: it must still hold step 2's values, not later ones
        ("async", True, "rank=0:sleep=1.5@step=1:phase=ckpt-write"),
    ]:
        cfg = Config.from_dict(base)
        cfg.run_dir, cfg.checkpoint.every, cfg.checkpoint.keep = f"{root}/{name}", 1, 10
        cfg.checkpoint.async_save, cfg.emulate.fault = async_save, fault
        p = cfg.parallel
        res = train(cfg, build_topology(p.dp, p.pp, p.tp, "gloo", p.timeout_s), log=False)
        out[name] = {"losses": res.losses, "digest": res.digest}
    return out


@pytest.mark.multiprocess
def test_async_checkpoints_hold_their_own_step(tmp_path: Path) -> None:
    cfg = tiny_config(train=dict(steps=4, val_every=0, monitor_every=0), parallel=dict(tp=1, pp=2, dp=1))
    r = run_ranks(_async_worker, 2, cfg.to_dict(), str(tmp_path), timeout_s=240)[0]
    assert r["async"] == r["sync"]
    assert json.loads((tmp_path / "async" / "chaos.jsonl").read_text().split("\n")[1])["fault"].startswith(
        "rank=0:sleep"
    )
    for step in range(1, 5):
        a, s = (tmp_path / d / "checkpoints" / f"step-{step:06d}" for d in ("async", "sync"))
        assert verify_checkpoint(a, step) is None
        assert params_digest(read_full_model(a, cfg.model).items()) == params_digest(
            read_full_model(s, cfg.model).items()
        )
