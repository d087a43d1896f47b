"""Hugging Face interop, for every model family: a tiny random LlamaForCausalLM / GPT2LMHeadModel made
offline loads into the tp=2 x pp=2 sharded model with logits within 1e-4 of transformers' (and the
engine's greedy tokens equal HF's greedy generate); our export loads back into transformers with equal
logits; what hybridpar's trainer writes (a DCP checkpoint and final/) is served."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridpar.config import Config, ModelConfig
from hybridpar.model.hf import StateSource
from hybridpar.model.registry import build_full_model, config_from_hf, export_hf, load_stage_, read_hf_config
from hybridpar.model.stage import generate
from hybridpar.resilience.checkpoint import read_full_model
from hybridpar.serve.driver import Driver, Limits
from hybridpar.serve.engine import StageRunner
from hybridpar.serve.worker import (
    WorkerSpec,
    build_serving_stage,
    resolve_source,
    serve_rank,
)
from hybridpar.topology.spawn import run_ranks
from tests.replica import ListChannel, local_topology


def _transformers():  # imported in the tests only: the spawned ranks import this module and must stay light
    return pytest.importorskip("transformers")


IDS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59, 4]]
LIMITS = {"max_batch": 2, "max_groups": 2, "kv_tokens": 1024, "max_seq_len": 64}
FAMILIES = ["llama", "gpt2"]


def tiny_hf(path: Path, tie: bool = False, family: str = "llama") -> torch.nn.Module:
    transformers = _transformers()
    torch.manual_seed(0)  # before construction: HF's random init draws from it too
    if family == "gpt2":  # GPT-2 ties its embeddings; 64 learned positions cover LIMITS' max_seq_len
        cfg = transformers.GPT2Config(
            vocab_size=256, n_embd=32, n_inner=64, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(cfg).eval()
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=tie,
        )
        model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases and sets norms to one: make every weight clearly non-trivial,
        for p in model.parameters():  # and large enough that greedy decoding does not repeat one token
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return model


def _sharded_rank(spec_d: dict, ids: list[list[int]], reqs: list[dict]) -> dict | None:
    """Full-sequence logits through the sharded stages (training forward path), then the engine."""
    spec = WorkerSpec(**spec_d)
    from hybridpar.topology.mesh import build_topology

    topo = build_topology(spec.dp, spec.pp, spec.tp, "gloo", 60)
    stage = build_serving_stage(spec, topo)
    x = torch.tensor(ids)
    logits = None
    with torch.no_grad():
        if topo.pp_rank == 0:
            dist.send(stage(x).contiguous(), topo.pp_peer(1))
        else:
            h = torch.empty(x.shape[0], x.shape[1], stage.cfg.dim)
            dist.recv(h, topo.pp_peer(0))
            logits = stage(h).tolist()
    ch = ListChannel(reqs)
    serve_rank(spec_d, ch)
    return {"logits": logits, "results": ch.results() if topo.rank == 0 else None}


def _sharded_ranks(cases: list[tuple[dict, list[list[int]], list[dict]]]) -> list[dict | None]:
    """_sharded_rank for each case in turn: each builds its own topology and stages from scratch."""
    return [_sharded_rank(*case) for case in cases]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module, list]]:
    """Each family's HF model (its own directory) through _sharded_rank at tp2 x pp2, both families in one
    launch: a launch costs ~5 s of four interpreters importing torch, more than this work. Per family:
    (directory, the HF model, every rank's result)."""
    dirs = {f: tmp_path_factory.mktemp(f"hf-{f}") for f in FAMILIES}
    models = {f: tiny_hf(dirs[f], family=f) for f in FAMILIES}
    reqs = [
        {"type": "generate", "id": str(i), "prompt": p, "max_tokens": 12, "temperature": 0} for i, p in enumerate(IDS)
    ]
    cases = []
    for f in FAMILIES:
        cfg = read_hf_config(dirs[f])
        spec = WorkerSpec(model=dataclasses.asdict(cfg), source=str(dirs[f]), tp=2, pp=2, limits=LIMITS, timeout_s=60)
        cases.append((dataclasses.asdict(spec), IDS, reqs))
    out = run_ranks(_sharded_ranks, 4, cases, timeout_s=240)  # per rank, per family
    return {f: (dirs[f], models[f], [r[i] for r in out]) for i, f in enumerate(FAMILIES)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_checkpoint_tp2_pp2(family: str, sharded: dict) -> None:
    tmp_path, hf, out = sharded[family]
    cfg = read_hf_config(tmp_path)
    assert (cfg.family, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim) == (
        family,
        32,
        4,
        4,
        2 if family == "llama" else 4,
        64,
    )
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits
        greedy = {
            str(i): hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
            for i, p in enumerate(IDS)
        }
    assert all(len(set(g)) > 3 for g in greedy.values())  # varied tokens: a stuck decoder would not match
    for r in (2, 3):  # both tp ranks of the last stage hold the gathered logits
        assert (torch.tensor(out[r]["logits"]) - want).abs().max().item() < 1e-4
    assert out[0]["results"] == greedy


@pytest.mark.parametrize("family,tie", [("llama", True), ("gpt2", None), ("gpt2", False)])
def test_export_loads_in_transformers(family: str, tie: bool | None, tmp_path: Path) -> None:
    extra = {"n_kv_heads": 2} if family == "llama" else {"n_positions": 32}
    cfg = ModelConfig(family=family, dim=32, n_layers=2, n_heads=4, ffn_dim=64, tie_embeddings=tie, **extra)
    ours = build_full_model(cfg, seed=5).eval()
    transformers = _transformers()
    export_hf(ours.state_dict(), cfg, tmp_path)
    assert read_hf_config(tmp_path).resolved() == cfg.resolved()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[family]
    with torch.no_grad():
        diff = (back(torch.tensor(IDS)).logits - ours(torch.tensor(IDS))).abs().max().item()
    assert diff < 1e-5


def test_unsupported_hf_configs_are_refused() -> None:
    base = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "vocab_size": 256,
    }
    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 2, "vocab_size": 256}
    for bad, word in (
        ({"model_type": "mistral"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type"),
        ({"head_dim": 16}, "head_dim"),
    ):
        with pytest.raises(ValueError, match=word):
            config_from_hf({**base, **bad})
    for bad, word in (
        ({"activation_function": "relu"}, "activation_function"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"scale_attn_weights": False}, "scale_attn_weights"),
        ({"add_cross_attention": True}, "add_cross_attention"),
    ):
        with pytest.raises(ValueError, match=word):
            config_from_hf({**gpt2, **bad})
    assert config_from_hf(gpt2).tied and config_from_hf(gpt2).max_positions == 1024  # GPT2Config's defaults


def _train_rank(cfg_d: dict) -> float:
    from hybridpar.run.train import train

    return train(Config.from_dict(cfg_d), log=False).losses[-1]


def _train_ranks(cfg_ds: list[dict]) -> list[float]:
    return [_train_rank(d) for d in cfg_ds]


def _trained_config(family: str, run_dir: Path) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(family=family, dim=32, n_layers=2, n_heads=4, ffn_dim=64)
    cfg.parallel.tp, cfg.parallel.pp = 2, 1
    t = cfg.train
    t.steps, t.global_batch, t.microbatches, t.seq_len, t.val_every, t.sample_tokens = 2, 4, 2, 16, 0, 0
    cfg.checkpoint.every, cfg.data.max_tokens, cfg.run_dir = 2, 100_000, str(run_dir)
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Config]:
    """Both families trained (each into its own run directory) in one 2-rank launch, not one each."""
    cfgs = {f: _trained_config(f, tmp_path_factory.mktemp(f"trained-{f}") / "run") for f in FAMILIES}
    run_ranks(_train_ranks, 2, [cfgs[f].to_dict() for f in FAMILIES], timeout_s=240)
    return cfgs


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_trained_checkpoint_is_served(family: str, trained: dict) -> None:
    cfg = trained[family]
    run = Path(cfg.run_dir)
    final = read_full_model(run / "checkpoints" / "step-000002", cfg.model)
    model = build_full_model(cfg.model, 0)
    load_stage_(model, StateSource(final), hf_layout=False)
    prompt = list(b"def ")
    want = generate(model, prompt, 6, temperature=0)
    req = [{"type": "generate", "id": "a", "prompt": prompt, "max_tokens": 6, "temperature": 0}]
    # The run directory resolves to its final/ (of the same step as its last checkpoint); the DCP
    # checkpoint serves too (config from trainer_state.json).
    source, mcfg = resolve_source(str(run), None)
    assert Path(source).name == "final" and mcfg.resolved() == cfg.model.resolved()
    ck_source, ck_cfg = resolve_source(str(run / "checkpoints" / "step-000002"), None)
    assert ck_cfg == cfg.model
    for src in (source, ck_source):
        stage = build_serving_stage(WorkerSpec(model=dataclasses.asdict(mcfg), source=src), local_topology())
        ch = ListChannel(req)
        Driver(StageRunner(stage, local_topology()), ch, Limits(**LIMITS)).run()
        assert ch.results() == {"a": want}, src
    # final/ is transformers' own, with the same greedy tokens.
    hf = _transformers().AutoModelForCausalLM.from_pretrained(run / "final").eval()
    with torch.no_grad():
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    assert got == want
