"""The parallel-agnostic model: HF names, layout-independent init, stage composition, GQA, tying."""

from __future__ import annotations

import torch

from hybridpar.config import ModelConfig
from hybridpar.model.llama import build_full_model, build_stage, canonical_param_names, generate

CFG = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)


def test_hf_parameter_names():
    names = canonical_param_names(CFG)
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert "model.layers.3.self_attn.k_proj.weight" in names and "model.norm.weight" in names
    assert "model.layers.0.post_attention_layernorm.weight" in names


def test_stage_built_alone_equals_full_model_slice():
    full = build_full_model(CFG, seed=7)
    stage = build_stage(CFG, range(2, 4), False, True, seed=7, device=torch.device("cpu"))
    full_params = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full_params[name]), name


def test_stages_compose_to_the_full_model():
    full = build_full_model(CFG, seed=3)
    a = build_stage(CFG, range(0, 1), True, False, 3, torch.device("cpu"))
    b = build_stage(CFG, range(1, 4), False, True, 3, torch.device("cpu"))
    ids = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(b(a(ids)), full(ids), rtol=0, atol=1e-6)


def test_gqa_shapes_and_causality():
    full = build_full_model(CFG, seed=0)
    assert full.model.layers["0"].self_attn.k_proj.weight.shape == (2 * 8, 32)
    ids = torch.randint(0, 256, (1, 10))
    out = full(ids)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 256
    # the last token cannot influence earlier positions
    torch.testing.assert_close(full(changed)[0, :-1], out[0, :-1])


def test_tied_embeddings_share_one_weight_and_split_copies_start_equal():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, ffn_dim=64, tie_embeddings=True)
    full = build_full_model(cfg, seed=1)
    assert full.lm_head.weight is full.model.embed_tokens.weight
    assert "lm_head.weight" not in canonical_param_names(cfg)
    last = build_stage(cfg, range(1, 2), False, True, 1, torch.device("cpu"))
    assert last.holds_tied_copy and torch.equal(last.lm_head.weight, full.model.embed_tokens.weight)


def test_generate_is_deterministic():
    full = build_full_model(CFG, seed=0)
    a = generate(full, [1, 2, 3], 5, seed=4)
    assert a == generate(full, [1, 2, 3], 5, seed=4) and len(a) == 5
    assert generate(full, [1, 2, 3], 5, temperature=0) == generate(full, [1, 2, 3], 5, temperature=0, seed=9)
