"""A mixture of corpora trains the same model at any layout as on one device, and a run resumed at
another dp size trains on exactly the samples of the uninterrupted one (the blend is a function of
(seed, sample index) only) and, with parallel.grad_sum tree, ends with its params digest. Tiny model
and runs of the equivalence tests; 4 ranks, one launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.config import Config
from hybridpar.data.sources import open_corpus
from hybridpar.model.reference import TOL, tiny_config
from hybridpar.topology.spawn import run_ranks
from tests.test_equivalence import check_results

pytestmark = pytest.mark.multiprocess


def _mixture(tmp_path: Path) -> str:
    """Three byte-level sources cut from the default corpus, weighted 0.5 : 0.3 : 0.2."""
    ids = open_corpus(None, 240_000).tokens
    for i in range(3):
        (tmp_path / f"s{i}.txt").write_bytes(ids[i * 80_000 : (i + 1) * 80_000].tobytes())
    return ",".join(f"{w}:{tmp_path / f's{i}.txt'}" for i, w in enumerate([0.5, 0.3, 0.2]))


def _worker(cfg_dicts: list[dict], out: str) -> dict:
    import torch

    from hybridpar.run.train import train

    res = {}
    for name, d in cfg_dicts:
        cfg = Config.from_dict(d)
        r = train(cfg, log=False)
        if r.state is not None and name == "layout":  # the reference check reads it
            torch.save(r.state, Path(out) / "state0.pt")
        res[name] = {"losses": r.losses, "val": r.val_losses, "digest": r.digest, "start": r.start_step}
    return res


def test_mixture_equals_one_device_and_resumes_across_dp(tmp_path: Path) -> None:
    spec = _mixture(tmp_path)
    layout = tiny_config(parallel=dict(tp=1, pp=2, dp=2, schedule="1f1b"), data=dict(path=spec, max_tokens=None))
    layout.run_dir = str(tmp_path / "layout")
    # Resume: 4 steps at pp2 x dp2 (2 microbatches per replica) checkpointed every 2, against the same
    # run resumed at step 2 at pp1 x dp4 (1 microbatch per replica: the same 4 microbatches of 4 samples),
    # and that run uninterrupted. parallel.grad_sum=tree sums the 4 microbatch gradients in one tree
    # whatever the layout (dataparallel/tree.py), so all three end with one digest.
    tree = dict(train=dict(steps=4, val_every=0, global_batch=16), data=dict(path=spec, max_tokens=None))
    full = tiny_config(
        parallel=dict(tp=1, pp=2, dp=2, schedule="1f1b", grad_sum="tree"), checkpoint=dict(every=2), **tree
    )
    full.train.microbatches = 2
    full.run_dir = str(tmp_path / "full")
    wide = tiny_config(parallel=dict(tp=1, pp=1, dp=4, grad_sum="tree"), **tree)
    wide.train.microbatches = 1
    wide.run_dir = str(tmp_path / "wide")
    resumed = Config.from_dict(wide.to_dict())
    resumed.run_dir = str(tmp_path / "resumed")
    resumed.checkpoint.resume = str(tmp_path / "full" / "checkpoints" / "step-000002")
    runs = [("layout", layout), ("full", full), ("resumed", resumed), ("wide", wide)]
    r = run_ranks(_worker, 4, [(n, c.to_dict()) for n, c in runs], str(tmp_path), timeout_s=400)[0]
    check_results([layout], [(r["layout"]["losses"], r["layout"]["val"])], tmp_path)
    recs = [json.loads(x) for x in (tmp_path / "layout" / "metrics.jsonl").read_text().splitlines()]
    by_source = [x["val_loss_by_source"] for x in recs if "val_loss" in x]
    names = [item.split(":", 1)[1] for item in spec.split(",")]  # each source's loss under its path
    assert len(by_source) == 2 and all(list(v) == names and min(v.values()) > 0 for v in by_source), by_source
    assert r["resumed"]["start"] == 2
    got, want = r["resumed"]["losses"], r["full"]["losses"][2:]
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, want)) <= TOL, (got, want)
    assert r["resumed"]["digest"] == r["full"]["digest"] == r["wide"]["digest"], r
