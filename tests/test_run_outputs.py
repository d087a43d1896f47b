"""A run directory describes itself: config.toml (read back by --config), the command line and versions
in run.json, train.log (rank-prefixed, the console's lines), final/ as a Hugging Face directory that
transformers loads; `hybridpar export` turns a run, checkpoint or step into one, and serving a run
takes its newest model with the shape it was trained with. Another run's records are never mixed in."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
import torch

from hybridpar import cli
from hybridpar.config import Config, ModelConfig, load_toml, parse_args, to_toml
from hybridpar.config.keys import _known_keys, _owner, _unwrap
from hybridpar.resilience import rundir
from hybridpar.topology.spawn import run_ranks
from hybridpar.trainer.export import RECORD, newest_artefact


def test_config_toml_reads_back_equal(tmp_path: Path) -> None:
    cfg = Config()
    cfg.model = ModelConfig(dim=48, n_heads=6, n_kv_heads=2, ffn_dim=96, tie_embeddings=True, norm_eps=1e-6)
    cfg.parallel.layer_costs, cfg.parallel.partition = [1.0, 2.5, 1e-3, 3.0], "cost"
    cfg.train.microbatch_sizes, cfg.train.sample_prompt = [3, 1], 'a "quoted"\\ line\n\tand \x7f é 🙂'
    cfg.data.path, cfg.trace = "corpus dir/x.bin", "t.json"
    (tmp_path / "c.toml").write_text(to_toml(cfg), encoding="utf-8")
    assert parse_args(["--config", str(tmp_path / "c.toml")]) == cfg
    assert parse_args(["--config", str(tmp_path / "c.toml")]) != Config()


def test_every_optional_key_defaults_to_none() -> None:
    """to_toml leaves keys at none out (TOML has no null): right only while none is their default."""
    fresh = Config()
    for key, f in _known_keys(Config).items():
        if _unwrap(f.type)[1]:
            assert getattr(*_owner(fresh, key)) is None, key
        assert typing.get_origin(f.type) is not dict, key  # a dict would need a TOML table


def test_all_bad_keys_of_a_file_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('run_dri = "x"\n[model]\ndimm = 3\nn_layers = "two"\n[train]\nsteps = 5\nlr = true\n')
    with pytest.raises(ValueError) as e:
        parse_args(["--config", str(path)])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"config file {str(path)!r}: ")
    for part in ("'run_dri' (did you mean 'run_dir'?)", "'model.dimm'", "'model.n_layers' expects int", "'train.lr'"):
        assert part in msg
    assert "train.steps" not in msg


def test_another_runs_records_without_a_run_record_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    for name in ("metrics.jsonl", "resilience.jsonl", "chaos.jsonl"):
        (run / name).write_text('{"step": 0}\n')
    (run / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match=r"holds another run's metrics.jsonl, resilience.jsonl, chaos.jsonl, final"):
        rundir.claim(run, run / "checkpoints", "off", overwrite=False)
    with pytest.raises(ValueError, match="--overwrite"):
        rundir.claim(run, run / "checkpoints", "auto", overwrite=False)
    c = rundir.claim(run, run / "checkpoints", "off", overwrite=True)
    c.release()
    # The injected-fault ledger is gone with the rest: the new run's faults fire again.
    assert sorted(p.name for p in run.iterdir()) == [".hybridpar.lock", "notes.txt", "run.json"]


def _train_rank(cfg_d: dict) -> str | None:
    from hybridpar.run.train import train

    return train(Config.from_dict(cfg_d), log=True).digest


def _tiny(run_dir: Path, steps: int, every: int) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=80)  # not the default shape
    cfg.parallel.tp, cfg.parallel.pp = 2, 1
    t = cfg.train
    t.steps, t.global_batch, t.microbatches, t.seq_len, t.val_every, t.sample_tokens = steps, 4, 2, 16, 0, 4
    cfg.checkpoint.every, cfg.data.max_tokens, cfg.run_dir = every, 60_000, str(run_dir)
    return cfg


@pytest.mark.multiprocess
def test_run_directory_describes_itself_and_serves_its_newest_model(tmp_path: Path, capfd) -> None:
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    cfg = _tiny(run, steps=7, every=5)
    digest = run_ranks(_train_rank, 2, cfg.to_dict(), timeout_s=180)[0]

    assert parse_args(["--config", str(run / "config.toml")]) == cfg
    launch = json.loads((run / "run.json").read_text())["launches"][-1]
    assert launch["command"] and launch["versions"]["torch"] == torch.__version__
    log = (run / "train.log").read_text().splitlines()
    assert {re.search(r"\[rank (\d)\]", line).group(1) for line in log if "[rank" in line} == {"0", "1"}
    console = capfd.readouterr().out
    shown = [x for x in log if "step 7/7" in x or "holds stage" in x or "trained model is in" in x]
    assert len(shown) == 4  # two ranks' start lines, the last step, where the model went
    for line in shown:
        assert "[rank" + line.split(" [rank", 1)[1] in console  # the console's line, with the time in front
    assert not (run / "final_model.pt").exists()

    # Serving the run takes final/ (step 7), not the newer-looking checkpoint of step 5, with its shape.
    from hybridpar.serve.main import prepare

    _, model_cfg, source = prepare(["--source", str(run), "--tp", "2"])
    assert Path(source) == run / "final" and model_cfg.resolved() == cfg.model.resolved()
    record = json.loads((run / "final" / RECORD).read_text())
    assert record["step"] == 7 and record["params_digest"] == digest
    assert newest_artefact(run, step=5) == run / "checkpoints" / "step-000005"

    # transformers loads final/ and a checkpoint exported by step; the two are different models.
    assert cli.main(["export", str(run), "--step", "5", "--out", str(tmp_path / "s5")]) == 0
    ids = torch.tensor([list(b"def main():")])
    logits = {}
    for name in ("run/final", "s5"):
        m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            logits[name] = m(ids).logits
    assert json.loads((tmp_path / "s5" / RECORD).read_text())["step"] == 5
    assert (logits["run/final"] - logits["s5"]).abs().max() > 1e-4
    from hybridpar.model.hf import SafetensorsDir
    from hybridpar.model.registry import build_full_model, load_stage_

    ours = build_full_model(cfg.model, 1)
    load_stage_(ours, SafetensorsDir(run / "final"), hf_layout=True)
    with torch.no_grad():
        assert (ours(ids) - logits["run/final"]).abs().max() < 1e-5
    assert cli.main(["export", str(run), "--step", "6", "--out", str(tmp_path / "s6")]) == 2
    assert "holds no checkpoint of step 6" in capfd.readouterr().err
    assert cli.main(["export", str(run / "checkpoints" / "step-000005"), "--step", "5", "--out", "x"]) == 2
    assert "is one model already" in capfd.readouterr().err
    assert cli.main(["export", str(run), "--out", str(tmp_path / "newest")]) == 0  # the newest: final/ (step 7)
    assert json.loads((tmp_path / "newest" / RECORD).read_text()) == record
    assert load_toml(str(run / "config.toml"))["model"]["dim"] == 48


def test_a_run_without_checkpoints_serves_with_its_own_shape(tmp_path: Path) -> None:
    """A run of a non-default shape that wrote no checkpoint is served from final/ with that shape (no
    `--model.*` retyped)."""
    from hybridpar.model.registry import build_full_model
    from hybridpar.serve.main import prepare
    from hybridpar.serve.worker import WorkerSpec, build_serving_stage
    from hybridpar.trainer.export import write_model_dir
    from tests.replica import local_topology

    run = tmp_path / "run"
    rundir.claim(run, run / "checkpoints", "off", overwrite=False).release()
    model = ModelConfig(dim=48, n_layers=3, n_heads=6, n_kv_heads=3, ffn_dim=80, vocab_size=300)
    state = {n: p.detach() for n, p in build_full_model(model, 3).named_parameters()}
    write_model_dir(state, model, run / "final", {"run_id": "x", "step": 4, "params_digest": "d"})
    _, got, source = prepare(["--source", str(run)])
    assert Path(source) == run / "final" and got.resolved() == model.resolved()
    stage = build_serving_stage(WorkerSpec(model=got.__dict__, source=source), local_topology())
    ids = torch.tensor([[1, 2, 299]])
    with torch.no_grad():
        assert (stage(ids) - build_full_model(model, 3)(ids)).abs().max() == 0
    assert newest_artefact(tmp_path / "nothing") is None


def test_export_of_a_step_the_run_lacks_names_the_steps_it_holds(tmp_path: Path, capsys) -> None:
    from hybridpar.resilience.commits import write_manifest

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"format": "hybridpar-run/1", "run_id": "r1", "state": "finished"}))
    (run / "final" / "config.json").write_text("{}")
    (run / "final" / RECORD).write_text(json.dumps({"run_id": "r1", "step": 45}))
    for step, run_id in ((30, "r1"), (40, "r1"), (20, "r0")):  # step 20: another run's, not offered
        ckpt = run / "checkpoints" / f"step-{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
        write_manifest(ckpt, step, run_id)
    assert newest_artefact(run, step=40) == run / "checkpoints" / "step-000040"
    assert cli.main(["export", str(run), "--step", "33", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"error: run directory {run} holds no checkpoint of step 33: --step takes one of 30, 40, 45" in err
    (run / "final" / "config.json").unlink()
    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / "manifest.json").unlink()
    assert cli.main(["export", str(run), "--step", "33", "--out", str(tmp_path / "x")]) == 2
    assert "holds no checkpoint of step 33: it holds no model yet" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
