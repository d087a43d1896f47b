"""A resume whose samples differ from the checkpoint's run's (another seed, batch, sequence length or
corpus) is said in one line before launch: the steps from the checkpoint on read other samples than the
uninterrupted run would have, and the sample ledger, kept by steps, would not show it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hybridpar.config import Config
from hybridpar.run.preflight import preflight


def _checkpoint(tmp_path: Path, cfg: Config) -> Path:
    ckpt = tmp_path / "step-000006"
    ckpt.mkdir()
    state = {"step": 6, "config": dataclasses.asdict(cfg)}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "manifest.json").write_text("{}")
    return ckpt


def test_a_resume_that_reads_other_samples_says_so(tmp_path: Path) -> None:
    saved = Config()
    saved.data.max_tokens = 200_000
    ckpt = _checkpoint(tmp_path, saved)
    same = Config()
    same.data.max_tokens = 200_000
    same.run_dir, same.checkpoint.resume = str(tmp_path / "run"), str(ckpt)
    _, notes = preflight(same, 4, verify=False)
    assert not [n for n in notes if "sample" in n], notes  # the same data order: nothing to say
    other = Config.from_dict(dataclasses.asdict(same))
    other.train.seq_len, other.train.global_batch = 64, 32
    _, notes = preflight(other, 4, verify=False)
    [note] = [n for n in notes if "sample" in n]
    assert "train.global_batch=32 (checkpoint: 16), train.seq_len=64 (checkpoint: 128)" in note, note
    assert "from step 6 on the run reads other samples than the checkpoint's run would have" in note, note
