"""Every parallel layout trains the same model as one device: per-step loss and every parameter after
3 AdamW steps within 1e-5 of a plain single-process fp32 run (torch.optim.AdamW, torch's clip). The
GPT-2 family runs the same grid, its parameters also held to DESIGN.md's fp64 criterion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hybridpar.config import Config, ModelConfig
from hybridpar.config.schedules import schedule_spec
from hybridpar.data import TokenData, load_tokens
from hybridpar.model.registry import build_full_model
from hybridpar.optim import lr_at, make_optimizer, set_lr
from hybridpar.testing import run_ranks

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TOL = 1e-5


def tiny_config(**over: dict) -> Config:
    cfg = Config()
    m, t = cfg.model, cfg.train
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = 32, 8, 4, 2, 64  # GQA on
    t.steps, t.global_batch, t.microbatches, t.seq_len = 3, 11, 4, 16  # 11 samples: unequal splits
    # lr stays the default (3e-3): Adam turns fp32 reduction-order noise in near-zero gradients into
    # parameter differences proportional to lr.
    t.warmup_steps, t.val_every, t.val_batches, t.sample_tokens = 1, 3, 1, 0
    t.grad_clip = 0.5  # low enough that clipping is active
    cfg.data.max_bytes = 200_000
    for section, values in over.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    return cfg


def final_state(run_dir: Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    """A finished run's final/ (a Hugging Face directory) as our full state dict, in definition order."""
    from hybridpar.model.hf import SafetensorsDir
    from hybridpar.model.registry import load_stage_

    full = build_full_model(model, 0)
    load_stage_(full, SafetensorsDir(Path(run_dir) / "final"), hf_layout=True)
    return {n: p.detach() for n, p in full.named_parameters()}


def reference(
    cfg: Config, dtype: torch.dtype = torch.float32
) -> tuple[list[float], list[tuple[int, float]], dict[str, torch.Tensor]]:
    t = cfg.train
    data = TokenData(load_tokens(cfg.data.path, cfg.data.max_bytes), t.seq_len, t.seed, cfg.data.val_fraction)
    model = build_full_model(cfg.model, t.seed).to(dtype)  # fp64: the same initial values, widened
    opt = make_optimizer(model.named_parameters(), t)
    losses, val_losses = [], []
    vx, vy = data.val_samples(t.val_batches * t.global_batch)
    for step in range(t.steps):
        set_lr(opt, lr_at(step, t))
        x, y = data.step_samples(step, t.global_batch, 0, t.global_batch)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0 or (step + 1) % t.val_every == 0 or step == t.steps - 1:
            with torch.no_grad():
                val_losses.append((step, F.cross_entropy(model(vx).flatten(0, 1), vy.flatten()).item()))
    return losses, val_losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(cfg_dicts: list[dict], out_dir: str) -> list[tuple[list, list]]:
    from hybridpar.train import train

    all_losses = []
    for i, d in enumerate(cfg_dicts):
        cfg = Config.from_dict(d)
        cfg.run_dir = str(Path(out_dir) / f"run{i}")  # one run per directory
        res = train(cfg, log=False)
        if res.state is not None:
            torch.save(res.state, Path(out_dir) / f"state{i}.pt")
        all_losses.append((res.losses, res.val_losses))
    return all_losses


def _tight_rings_worker(cfg_dicts: list[dict], out_dir: str) -> list[tuple[list, list]]:
    """_worker with shared-memory rings of 4 messages at first: they wrap and grow all the time, so
    a message released while something still reads it would be overwritten (and the result wrong)."""
    from hybridpar.pipeline import shm

    shm._MIN_CAPACITY = 0
    return _worker(cfg_dicts, out_dir)


LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 2, 2)]


def schedules_for(pp: int) -> list[tuple[str, int]]:
    out = [("gpipe", 1), ("1f1b", 1)]
    if pp > 1:
        # zb-v: two chunks per rank in a V, the first and last stage (and a tied embedding's two copies)
        # on rank 0, the turn between its chunks a local hand-off on the last rank.
        out += [("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]
    return out


def grid_config(pp: int, schedule: str, v: int, **over: dict) -> Config:
    """tiny_config running `schedule`, with the microbatches it needs (zb-v: 2 pp - 1, so 8 at pp=4)."""
    cfg = tiny_config(**over)
    cfg.parallel.schedule, cfg.parallel.virtual_stages = schedule, v
    cfg.train.microbatches = max(cfg.train.microbatches, schedule_spec(schedule).min_microbatches(pp))
    return cfg


_REF: dict[str, tuple] = {}  # the reference depends on model and train settings only


def ref_for(cfg: Config, dtype: torch.dtype = torch.float32) -> tuple:
    key = repr((cfg.model, cfg.train, dtype))
    if key not in _REF:
        _REF[key] = reference(cfg, dtype)
    return _REF[key]


FP64_RATIO = 1.5  # DESIGN.md: no farther from the fp64 run than the single-process fp32 run, within 1.5x


def check_fp64(label: str, state: dict[str, torch.Tensor], cfg: Config) -> None:
    """DESIGN.md's parameter criterion: the whole model's distance to an fp64 run of the same training,
    as the largest difference and as the L2 norm of all differences, at most 1.5x the single-process
    fp32 run's. Whole-model, not per tensor: a tensor's own distance sits at a few fp32 ulps, so the
    ratio of two runs' is noise (measured up to 14x per tensor on Llama layouts whose loss and every
    parameter are within 1e-5, and whose whole-model ratio is 1.1)."""
    ref32, ref64 = ref_for(cfg)[2], ref_for(cfg, torch.float64)[2]
    for what, dist in (
        ("largest difference", lambda s: max((s[n].double() - r).abs().max().item() for n, r in ref64.items())),
        (
            "L2 norm of the differences",
            lambda s: sum((s[n].double() - r).pow(2).sum().item() for n, r in ref64.items()) ** 0.5,
        ),
    ):
        ours, single = dist(state), dist(ref32)
        assert ours <= FP64_RATIO * single, (
            f"{label}: {what} to the fp64 run is {ours:.3g}, more than "
            f"{FP64_RATIO} x the single-process fp32 run's {single:.3g}"
        )


def check_layouts(cfgs: list[Config], tmp_path: Path, worker=_worker, fp64: bool = False) -> None:
    world = cfgs[0].parallel.world_size
    results = run_ranks(worker, world, [c.to_dict() for c in cfgs], str(tmp_path), timeout_s=400)
    for i, cfg in enumerate(cfgs):
        ref_losses, ref_val, ref_state = ref_for(cfg)
        p = cfg.parallel
        label = f"tp={p.tp} pp={p.pp} dp={p.dp} {p.schedule} v={p.chunks} m={cfg.train.microbatches}"
        losses, val = results[0][i]
        assert len(losses) == len(ref_losses) and len(val) == len(ref_val) == 2
        for (s, a), (_, b) in zip(val, ref_val):
            assert abs(a - b) <= TOL, f"{label}: validation loss after step {s}: {a} vs single device {b}"
        for s, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= TOL, f"{label}: step {s} loss {a} vs single device {b}"
        state = torch.load(tmp_path / f"state{i}.pt", weights_only=True)
        assert list(state) == list(ref_state), f"{label}: parameter names/order differ"
        for name, ref in ref_state.items():
            diff = (state[name] - ref).abs().max().item()
            assert diff <= TOL, f"{label}: {name} differs from single device by {diff:.3g}"
        if fp64:
            check_fp64(label, state, cfg)


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=[f"tp{a}-pp{b}-dp{c}" for a, b, c in LAYOUTS])
def test_layout_matches_single_device(tp: int, pp: int, dp: int, tmp_path: Path) -> None:
    cfgs = [grid_config(pp, s, v, parallel=dict(tp=tp, pp=pp, dp=dp)) for s, v in schedules_for(pp)]
    check_layouts(cfgs, tmp_path)


def test_pipelines_over_tight_shared_memory_rings(tmp_path: Path) -> None:
    cfgs = [grid_config(4, s, v, parallel=dict(tp=1, pp=4, dp=1, p2p="shared_memory")) for s, v in schedules_for(4)]
    check_layouts(cfgs, tmp_path, _tight_rings_worker)


def test_tied_embeddings_across_stages(tmp_path: Path) -> None:
    cfgs = [
        tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=2, pp=2, dp=1, schedule="1f1b")),
        tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=1, pp=2, dp=2, schedule="gpipe")),
        tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=2, pp=1, dp=2, schedule="1f1b")),
        # zb-v: the embedding and the head it is tied to are two stages of rank 0
        tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=2, pp=2, dp=1, schedule="zb-v")),
    ]
    check_layouts(cfgs, tmp_path)


def test_explicit_unequal_microbatches(tmp_path: Path) -> None:
    cfg = tiny_config(
        parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b"), train=dict(global_batch=10, microbatch_sizes=[4, 1, 2, 3])
    )
    check_layouts([cfg], tmp_path)


GPT2_LAYOUTS = [(2, 2, 1), (1, 2, 2), (2, 1, 2)]


def gpt2_config(**parallel: Any) -> Config:
    """The tiny model of the grid as GPT-2: biases, LayerNorm, learned positions, tied embeddings."""
    return tiny_config(model=dict(family="gpt2", n_kv_heads=None, n_positions=24), parallel=parallel)


@pytest.mark.parametrize("tp,pp,dp", GPT2_LAYOUTS, ids=[f"tp{a}-pp{b}-dp{c}" for a, b, c in GPT2_LAYOUTS])
def test_gpt2_layout_matches_single_device(tp: int, pp: int, dp: int, tmp_path: Path) -> None:
    cfgs = [gpt2_config(tp=tp, pp=pp, dp=dp, schedule=s, virtual_stages=v) for s, v in schedules_for(pp)]
    check_layouts(cfgs, tmp_path, fp64=True)
