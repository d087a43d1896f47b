"""Mixtures of corpora (`data.path = "0.7:a.bin,0.3:b.bin"`): each sample's source a pure function of its
index, the shares exact, the same samples whatever the dp slicing or the step a run resumes at, every
source checked before launch. Pure: small corpora under tmp_path, no process started (the trained
equivalence of a mixture against one device: tests/test_mixture_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpar import cli
from hybridpar.data.corpus import TokenData
from hybridpar.data.mixture import BLOCK, MixtureData, blend_pattern, open_data, parse_mixture


def _files(tmp_path: Path, n: int = 3) -> list[Path]:
    """n nanoGPT token files, source s holding ids 1000 s .. 1000 s + 999 (so a window names its source)."""
    out = []
    for s in range(n):
        ids = (1000 * s + np.random.default_rng(s).integers(0, 1000, size=20_000)).astype("<u2")
        ids.tofile(p := tmp_path / f"s{s}.bin")
        out.append(p)
    return out


def test_parse_keeps_single_paths_and_names_bad_items(tmp_path: Path) -> None:
    odd = tmp_path / "a:b.txt"
    odd.write_text("x")
    assert parse_mixture(None) is None and parse_mixture("web.bin") is None and parse_mixture(str(odd)) is None
    assert parse_mixture("0.7:web.bin, 0.3 : code.bin") == [(0.7, "web.bin"), (0.3, "code.bin")]
    for spec, want in [
        ("0.7:a.bin,0:b.bin", "the weight of 'b.bin' is 0; each weight must be a number > 0"),
        ("0.7:a.bin,-1:b.bin", "the weight of 'b.bin' is -1"),
        ("0.7:a.bin,inf:b.bin", "the weight of 'b.bin' is inf"),
        ("x:a.bin", "'x:a.bin' is not WEIGHT:PATH"),
        ("0.5:a.bin,b.bin", "'b.bin' is not WEIGHT:PATH"),
        ("1:a.bin,1:a.bin", "'a.bin' is named twice"),
    ]:
        with pytest.raises(ValueError, match=want.replace("(", r"\(")):
            parse_mixture(spec)


def test_shares_are_the_weights_over_1000_steps() -> None:
    weights = [0.5, 0.3, 0.2]
    source, rank, per_block = blend_pattern(weights)
    assert per_block.tolist() == [500, 300, 200] and sorted(zip(source, rank)) == sorted(set(zip(source, rank)))
    for w in ([0.7, 0.3], [1.0, 2.0, 3.0, 0.01], [0.123, 0.877]):
        mix = MixtureData.__new__(MixtureData)  # only the pattern: no corpus needed to map indices
        mix.source, mix.rank, mix.per_block = blend_pattern(w)
        steps, batch = 1000, 11
        src, within = mix._locate(np.arange(steps * batch))
        share = np.bincount(src, minlength=len(w)) / (steps * batch)
        assert np.all(np.abs(share - np.asarray(w) / sum(w)) <= 0.02), (w, share)
        for s in range(len(w)):  # each source's samples taken in order, none twice, none skipped
            assert np.array_equal(within[src == s], np.arange((src == s).sum()))
        # every short stretch too: any window of 100 consecutive samples is within 2 samples of each share
        counts = np.stack([np.convolve(src == s, np.ones(100), "valid") for s in range(len(w))])
        assert np.all(np.abs(counts - 100 * np.asarray(w)[:, None] / sum(w)) <= 2)


def test_samples_depend_on_seed_and_index_only(tmp_path: Path) -> None:
    files = _files(tmp_path)
    spec = ",".join(f"{w}:{p}" for w, p in zip([0.5, 0.3, 0.2], files))
    mix = open_data(spec, None, 16, 7, 0.1)
    assert isinstance(mix, MixtureData)
    whole_x, whole_y = mix.step_samples(5, 12, 0, 12)
    for dp in (2, 3, 4):  # the replicas' slices put together are the global batch
        parts = [mix.step_samples(5, 12, r * 12 // dp, 12 // dp) for r in range(dp)]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole_x)
    again = open_data(spec, None, 16, 7, 0.1)  # a fresh process resuming at step 5 reads the same
    assert torch.equal(again.step_samples(5, 12, 0, 12)[1], whole_y)
    assert not torch.equal(open_data(spec, None, 16, 8, 0.1).step_samples(5, 12, 0, 12)[0], whole_x)
    # each sample is its source's own window: the ids say which source, the window is that source's sample
    src, within = mix._locate(np.arange(60, 72))
    for i, (s, j) in enumerate(zip(src, within)):
        assert int(whole_x[i, 0]) // 1000 == s
        alone = TokenData.open(str(files[s]), None, 16, 7, 0.1).train_samples(int(j), 1)[0]
        assert torch.equal(whole_x[i], alone[0])


def test_validation_blends_the_tails_and_each_source_alone(tmp_path: Path) -> None:
    files = _files(tmp_path, 2)
    mix = open_data(f"3:{files[0]},1:{files[1]}", None, 16, 0, 0.1)
    vx, _ = mix.val_samples(8)
    assert (vx[:, 0] // 1000).tolist() == [0, 0, 1, 0, 0, 0, 1, 0]  # 3 : 1, interleaved
    alone = mix.val_sources(5)
    assert list(alone) == [str(f) for f in files]
    assert torch.equal(alone[str(files[0])][0][:3], vx[[0, 1, 3]])
    with pytest.raises(ValueError, match="give only"):
        mix.val_samples(mix.n_val_windows + 1)


def test_a_weight_too_small_to_sample_is_refused(tmp_path: Path) -> None:
    files = _files(tmp_path, 2)
    with pytest.raises(ValueError, match=f"below 1/{2 * BLOCK} of the total"):
        open_data(f"1:{files[0]},0.0001:{files[1]}", None, 16, 0, 0.1)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run as tdr

    monkeypatch.setattr(tdr, "run", lambda *a, **k: pytest.fail("a worker was launched for bad input"))


@pytest.mark.parametrize(
    "kind, want",
    [
        ("weight", "the weight of"),
        ("missing", "does not exist"),
        ("tokenizer", "was prepared with the tokenizer"),
        ("vocab", "model.vocab_size=256 must be at least"),
    ],
)
def test_every_source_is_checked_before_launch(
    kind: str, want: str, tmp_path: Path, no_launch: None, capsys: pytest.CaptureFixture
) -> None:
    a, b = _files(tmp_path, 2)
    spec = {
        "weight": f"1:{a},0:{b}",
        "missing": f"1:{a},1:{tmp_path / 'none.bin'}",
        "tokenizer": f"1:{a},1:{_prepared(tmp_path)}",
        "vocab": f"1:{a},1:{b}",
    }[kind]
    vocab = "256" if kind == "vocab" else "2000"
    capsys.readouterr()
    flags = ["--data.path", spec, "--model.vocab_size", vocab, "--train.seq_len", "16"]
    rc = cli.main(["train", *flags, "--parallel.tp", "1", "--parallel.pp", "1", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and want in err, err
    assert not (tmp_path / "r").exists()


def _prepared(tmp_path: Path) -> Path:
    """A token file of `hybridpar data prepare`, with its description naming its tokenizer."""
    tok = tmp_path / "tok"
    assert cli.main(["data", "train-tokenizer", "--vocab-size", "300", "--out", str(tok), "--max-bytes", "20000"]) == 0
    out = tmp_path / "p.bin"
    assert cli.main(["data", "prepare", "--tokenizer", str(tok), "--out", str(out), "--max-bytes", "20000"]) == 0
    return out
