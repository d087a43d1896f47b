"""Hugging Face interop: a tiny random LlamaForCausalLM made offline loads into the tp=2 x pp=2
sharded model with logits within 1e-4 of transformers' (and the engine's greedy tokens equal HF's
greedy generate); our export loads back into transformers with equal logits; a checkpoint written
by hybridpar's trainer (DCP directory and final_model.pt) is served."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridpar.config import Config, ModelConfig
from hybridpar.model.hf import config_from_hf, export_hf, read_hf_config
from hybridpar.model.llama import build_full_model, generate
from hybridpar.serve.channel import ListChannel
from hybridpar.serve.driver import Driver, Limits
from hybridpar.serve.engine import StageRunner
from hybridpar.serve.worker import (WorkerSpec, build_serving_stage, local_topology, resolve_source, serve_rank,
                                    spec_dict)
from hybridpar.testing import run_ranks



def _transformers():  # imported in the tests only: the spawned ranks import this module and must stay light
    return pytest.importorskip("transformers")
IDS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59, 4]]
LIMITS = {"max_batch": 2, "max_groups": 2, "kv_tokens": 1024, "max_seq_len": 64}


def tiny_hf(path: Path, tie: bool = False) -> torch.nn.Module:
    transformers = _transformers()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                   tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-inits nothing here, but make every weight clearly non-trivial
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
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


@pytest.mark.multiprocess
def test_hf_checkpoint_tp2_pp2(tmp_path: Path) -> None:
    hf = tiny_hf(tmp_path)
    cfg = read_hf_config(tmp_path)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim) == (32, 4, 4, 2, 64)
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits
        greedy = hf.generate(torch.tensor(IDS[:1]), max_new_tokens=8, do_sample=False)[0, len(IDS[0]):].tolist()
    spec = spec_dict(WorkerSpec(model=dataclasses.asdict(cfg), source=str(tmp_path), tp=2, pp=2, limits=LIMITS,
                                timeout_s=60))
    reqs = [{"type": "generate", "id": "a", "prompt": IDS[0], "max_tokens": 8, "temperature": 0}]
    out = run_ranks(_sharded_rank, 4, spec, IDS, reqs, timeout_s=120)
    for r in (2, 3):  # both tp ranks of the last stage hold the gathered logits
        assert (torch.tensor(out[r]["logits"]) - want).abs().max().item() < 1e-4
    assert out[0]["results"]["a"] == greedy


def test_export_loads_in_transformers(tmp_path: Path) -> None:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, tie_embeddings=True)
    ours = build_full_model(cfg, seed=5).eval()
    transformers = _transformers()
    export_hf(ours.state_dict(), cfg, tmp_path)
    assert read_hf_config(tmp_path) == dataclasses.replace(cfg, init_std=cfg.init_std)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        diff = (back(torch.tensor(IDS)).logits - ours(torch.tensor(IDS))).abs().max().item()
    assert diff < 1e-5


def test_unsupported_hf_configs_are_refused() -> None:
    base = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 64, "vocab_size": 256}
    for bad, word in (({"model_type": "mistral"}, "model_type"), ({"hidden_act": "gelu"}, "hidden_act"),
                      ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
                      ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type"), ({"head_dim": 16}, "head_dim")):
        with pytest.raises(ValueError, match=word):
            config_from_hf({**base, **bad})


def _train_rank(cfg_d: dict) -> float:
    from hybridpar.train import train

    return train(Config.from_dict(cfg_d), log=False).losses[-1]


@pytest.mark.multiprocess
def test_trained_checkpoint_is_served(tmp_path: Path) -> None:
    cfg = Config()
    cfg.model = ModelConfig(dim=32, n_layers=2, n_heads=4, ffn_dim=64)
    cfg.parallel.tp, cfg.parallel.pp = 2, 1
    t = cfg.train
    t.steps, t.global_batch, t.microbatches, t.seq_len, t.val_every, t.sample_tokens = 2, 4, 2, 16, 0, 0
    cfg.checkpoint.every, cfg.data.max_bytes, cfg.run_dir = 2, 100_000, str(tmp_path / "run")
    run_ranks(_train_rank, 2, cfg.to_dict(), timeout_s=120)
    run = tmp_path / "run"
    final = torch.load(run / "final_model.pt", weights_only=True)
    model = build_full_model(cfg.model, 0)
    model.load_state_dict(final)
    prompt = list(b"def ")
    want = generate(model, prompt, 6, temperature=0)
    req = [{"type": "generate", "id": "a", "prompt": prompt, "max_tokens": 6, "temperature": 0}]
    # The run directory resolves to its newest DCP checkpoint (config from trainer_state.json), and
    # final_model.pt serves too, given the model shape.
    source, mcfg = resolve_source(str(run), None)
    assert Path(source).name == "step-000002" and mcfg == cfg.model
    for src in (source, resolve_source(str(run / "final_model.pt"), cfg.model)[0]):
        stage = build_serving_stage(WorkerSpec(model=dataclasses.asdict(mcfg), source=src), local_topology())
        ch = ListChannel(req)
        Driver(StageRunner(stage, local_topology()), ch, Limits(**LIMITS)).run()
        assert ch.results() == {"a": want}, src
