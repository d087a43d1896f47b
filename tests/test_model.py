"""The parallel-agnostic model: HF names, layout-independent init, stage composition, GQA, tying; the
family registry; GPT-2's names, init, tie and Hugging Face layout."""

from __future__ import annotations

import torch

from hybridpar.config import ModelConfig
from hybridpar.config import families as config_families
from hybridpar.model import gpt2, registry
from hybridpar.model.hf import StateSource
from hybridpar.model.registry import build_full_model, build_stage, canonical_param_names
from hybridpar.model.stage import generate

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


# ---- the family registry and GPT-2 ------------------------------------------------------------------------------

GPT2 = ModelConfig(family="gpt2", dim=32, n_layers=4, n_heads=4, ffn_dim=64, n_positions=16)


def test_every_configurable_family_has_a_model() -> None:
    assert set(registry.FAMILIES) == set(config_families.FAMILIES)
    for name, fam in registry.FAMILIES.items():
        assert (
            fam.name == name
            and config_families.FAMILIES[name].tied
            == fam.stage(ModelConfig(family=name, n_layers=1), [0], True, True).cfg.tied
        )


def test_gpt2_names_ties_and_init() -> None:
    names = canonical_param_names(GPT2)
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"] and names[-1] == "transformer.ln_f.bias"
    assert "transformer.h.3.attn.c_attn.bias" in names and "lm_head.weight" not in names  # tied, as GPT-2
    full = build_full_model(GPT2, seed=2)
    assert full.lm_head.weight is full.transformer.wte.weight and full.transformer.wpe.weight.shape == (16, 32)
    block = full.transformer.h["1"]
    assert torch.equal(block.ln_1.weight, torch.ones(32)) and torch.equal(block.attn.c_attn.bias, torch.zeros(96))
    # GPT-2's scaled init of the residual-branch outputs (GPT2PreTrainedModel._init_weights)
    assert block.mlp.c_proj.weight.std() < 0.6 * block.mlp.c_fc.weight.std()
    last = build_stage(GPT2, range(2, 4), False, True, 2, torch.device("cpu"))
    assert last.holds_tied_copy and torch.equal(last.lm_head.weight, full.transformer.wte.weight)
    a = build_stage(GPT2, range(0, 2), True, False, 2, torch.device("cpu"))
    ids = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(last(a(ids)), full(ids), rtol=0, atol=1e-6)


def test_gpt2_hf_layout_round_trip() -> None:
    """to_hf writes HF's Conv1D (in, out) and [q|k|v] column order; read_hf reads it back, whole or as a
    tensor-parallel rank's contiguous block of heads."""
    full = build_full_model(GPT2, seed=4)
    ours = {n: p.detach() for n, p in full.named_parameters()}
    files = StateSource({n: gpt2.to_hf(n, t, GPT2) for n, t in ours.items()})
    w = "transformer.h.0.attn.c_attn.weight"
    assert files.shape(w) == (32, 96) and files.shape("transformer.h.0.mlp.c_fc.weight") == (32, 64)
    # head_dim 8: HF's q columns of head 1 (8..15) are our rows 24..31 (head 1's block of 3 x 8 rows,
    # q first), its v columns (2 x 32 + 8..15) our rows 40..47.
    assert torch.equal(files.read(w)[:, 8:16].t(), ours[w][24:32])
    assert torch.equal(files.read(w)[:, 72:80].t(), ours[w][40:48])
    for n, t in ours.items():
        assert torch.equal(gpt2.read_hf(files, n, None, 0, 1, GPT2), t), n
    for n in (w, "transformer.h.0.attn.c_attn.bias", "transformer.h.0.mlp.c_fc.weight"):
        for rank in (0, 1):
            assert torch.equal(gpt2.read_hf(files, n, 0, rank, 2, GPT2), ours[n].chunk(2)[rank]), (n, rank)
    n = "transformer.h.0.mlp.c_proj.weight"  # row-parallel: split by input
    assert torch.equal(gpt2.read_hf(files, n, 1, 1, 2, GPT2), ours[n].chunk(2, dim=1)[1])


def test_param_counts_and_flops_follow_the_modules() -> None:
    llama = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)
    n = registry.param_counts(llama)  # q, o: 32x32; k, v: 32x16; gate, up, down: 32x64; two norms
    assert (n.embed, n.layer, n.head, n.layer_matmul) == (
        256 * 32,
        2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 64,
        32 + 256 * 32,
        2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64,
    )
    g = registry.param_counts(GPT2)  # tied: the head adds only ln_f
    assert (g.embed, g.head) == (256 * 32 + 16 * 32, 64)
    assert g.layer == 4 * 32 * 32 + 4 * 32 + 2 * 32 * 64 + 64 + 32 + 4 * 32
    assert registry.layer_flops_per_token(GPT2, 16) == 2.0 * (4 * 32 * 32 + 2 * 32 * 64) + 4.0 * 16 * 32
