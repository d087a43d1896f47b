"""Training from a Hugging Face model (--model.init_from): the shape from its config.json (Llama 3's
rope scaling, GQA, tied or untied embeddings), logits equal to transformers', fine-tuning at tp2 x pp2
equal to one device, and every bad input refused before any worker starts, naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridpar import cli
from hybridpar.config import Config, ModelConfig, parse_args
from hybridpar.model.hf import SafetensorsDir
from hybridpar.model.registry import build_full_model, config_from_hf, load_stage_, read_hf_config
from hybridpar.run.preflight import preflight
from hybridpar.topology.spawn import run_ranks

IDS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 0]]
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def llama3_hf(path: Path, tie: bool = False, vocab: int = 256, seed: int = 0) -> torch.nn.Module:
    """A tiny Llama-3-style model saved by transformers: GQA, rope theta 500000, llama3 rope scaling
    (original context 16, so that every frequency band is touched), weights clearly non-trivial."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={**ROPE, "original_max_position_embeddings": 16},
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_llama3_rope_scaling_logits_equal_transformers(tie: bool, tmp_path: Path) -> None:
    hf = llama3_hf(tmp_path, tie)
    cfg = read_hf_config(tmp_path)
    assert (cfg.rope_scaling, cfg.rope_original_max_positions, cfg.rope_theta, cfg.kv_heads, cfg.tied) == (
        "llama3",
        16,
        500000.0,
        2,
        tie,
    )
    ours = build_full_model(cfg, 0).eval()
    load_stage_(ours, SafetensorsDir(tmp_path), hf_layout=True)
    with torch.no_grad():
        assert (ours(torch.tensor(IDS)) - hf(torch.tensor(IDS)).logits).abs().max() < 1e-5
        unscaled = build_full_model(ModelConfig(**{**cfg.__dict__, "rope_scaling": "none"}), 0).eval()
        load_stage_(unscaled, SafetensorsDir(tmp_path), hf_layout=True)
        assert (unscaled(torch.tensor(IDS)) - hf(torch.tensor(IDS)).logits).abs().max() > 1e-3  # scaling matters


def test_every_unsupported_field_is_named_at_once() -> None:
    base = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "vocab_size": 256,
        "rope_scaling": {**ROPE, "original_max_position_embeddings": 16},
        "transformers_version": "5.0",
        "bos_token_id": 1,
    }
    assert config_from_hf(base).rope_scaling == "llama3"
    bad = {**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "attention_dropout": 0.1, "sliding_window": 8}
    with pytest.raises(ValueError) as e:
        config_from_hf(bad, "x/config.json")
    msg = str(e.value)
    assert msg.startswith("x/config.json: unsupported for model_type='llama': ")
    assert all(k in msg for k in ("rope_scaling={'rope_type': 'yarn'", "attention_dropout=0.1", "sliding_window=8"))


def _train_rank(cfg_d: dict) -> list[float]:
    from hybridpar.run.train import train

    return train(Config.from_dict(cfg_d), log=False).losses


def _finetune(hf_dir: Path, run_dir: Path, tp: int, pp: int) -> Config:
    cfg = parse_args(["--model.init_from", str(hf_dir)])
    cfg.parallel.tp, cfg.parallel.pp = tp, pp
    t = cfg.train
    t.steps, t.global_batch, t.microbatches, t.seq_len, t.val_every, t.sample_tokens = 2, 4, 2, 24, 0, 0
    t.warmup_steps, t.lr = 0, 1e-2  # a full learning rate from the first step: the steps move the weights
    cfg.data.max_tokens, cfg.run_dir = 60_000, str(run_dir)
    return preflight(cfg, tp * pp)[0]


def _train_ranks(cfg_ds: list[dict]) -> list[list[float]]:
    return [_train_rank(d) for d in cfg_ds]


TIES = [False, True]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[Path, Config, Config, list, list]]:
    """Both models (untied, tied) fine-tuned on one device in one launch and at tp2 x pp2 in another: a
    launch costs 2-5 s of interpreters importing torch before its first step, more than these 2-step runs.
    Each run trains its own directory from its own Hugging Face model; each test reads only its own."""
    runs = {}
    for tie in TIES:
        tmp = tmp_path_factory.mktemp(f"tie{tie}")
        llama3_hf(tmp / "hf", tie)
        runs[tie] = (tmp, _finetune(tmp / "hf", tmp / "one", 1, 1), _finetune(tmp / "hf", tmp / "four", 2, 2))
    refs = run_ranks(_train_ranks, 1, [runs[t][1].to_dict() for t in TIES], timeout_s=120)[0]
    gots = run_ranks(_train_ranks, 4, [runs[t][2].to_dict() for t in TIES], timeout_s=180)[0]
    return {t: (*runs[t], refs[i], gots[i]) for i, t in enumerate(TIES)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("tie", TIES)
def test_finetuning_from_hf_at_tp2_pp2_equals_one_device(tie: bool, finetuned: dict) -> None:
    tmp_path, one, four, ref, got = finetuned[tie]
    assert four.model == one.model and one.model.rope_scaling == "llama3" and one.model.tied == tie
    assert len(ref) == 2 and ref[0] != ref[1]
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
    # The first loss is the HF model's own on the first batch: nothing of ours was initialised.
    assert abs(ref[0] - _hf_loss(tmp_path / "hf", one)) <= 1e-5


def _hf_loss(hf_dir: Path, cfg: Config) -> float:
    from hybridpar.data.corpus import TokenData

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    t = cfg.train
    data = TokenData.open(cfg.data.path, cfg.data.max_tokens, t.seq_len, t.seed, cfg.data.val_fraction)
    x, y = data.step_samples(0, t.global_batch, 0, t.global_batch)
    with torch.no_grad():
        logits = hf(x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


@pytest.fixture
def no_launch(monkeypatch):
    import torch.distributed.run as tdr

    def boom(*a, **k):
        raise AssertionError("a worker was launched for bad input")

    monkeypatch.setattr(tdr, "run", boom)


def _corrupt(kind: str, d: Path) -> str:
    """Spoil the model directory `d` one way; returns what the error must name."""
    weights = d / "model.safetensors"
    if kind == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
        return f"{weights} cannot be read as safetensors"
    if kind == "architecture":
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "model_type": "mistral"}))
        return f"{d / 'config.json'}: model_type='mistral' is not supported"
    if kind == "field":
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "sliding_window": 4}))
        return f"{d / 'config.json'}: unsupported for model_type='llama': sliding_window=4"
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    return f"{d}: tensor 'model.layers.1.mlp.up_proj.weight' is missing"


@pytest.mark.parametrize("kind", ["truncated", "architecture", "field", "missing"])
def test_bad_hf_directory_refused_before_launch(kind: str, tmp_path: Path, no_launch, capsys) -> None:
    llama3_hf(tmp_path / "hf")
    want = _corrupt(kind, tmp_path / "hf")
    capsys.readouterr()  # transformers' own output while saving
    code = cli.main(["train", "--model.init_from", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and want in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_shape_keys_contradicting_config_json_are_refused(tmp_path: Path, no_launch, capsys) -> None:
    llama3_hf(tmp_path / "hf")
    capsys.readouterr()
    argv = ["train", "--model.init_from", str(tmp_path / "hf"), "--model.dim", "64", "--model.n_layers", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "model.dim=64 (config.json: 32) contradicts: leave it unset" in err and "n_layers" not in err
