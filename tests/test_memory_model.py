"""The analytic memory model (plan/memory_model.py) against what is really held: per-op activation formulas
against the activation meter on real layers (each family, fp32 and bf16, every recomputation mode),
parameter and optimizer bytes against the registry and ZeRO-1's slicing, the schedule walk, and one
small multi-process run whose per-rank counts (trainer/held.py) the model must match within 10%."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_equivalence import tiny_config

from hybridpar.config import Config
from hybridpar.dataparallel.zero import slice_of
from hybridpar.model.registry import build_stage, full_shapes, param_stages
from hybridpar.pipeline.activation_meter import ActivationMeter
from hybridpar.pipeline.runtime import step_casts, token_cross_entropy
from hybridpar.pipeline.split_backward import WeightGradDeferral
from hybridpar.plan.activations import ends_saved, layer_saved, step_saved, table_casts, weight_casts, weight_held
from hybridpar.plan.memory_model import bucket_bytes, optimizer_bytes, rank_memory, stage_shapes
from hybridpar.topology.spawn import run_ranks
from hybridpar.trainer.build import layer_partition

MODES = ("none", "full", "selective")


def small(family: str, precision: str = "fp32", **parallel: object) -> Config:
    """`precision` "copies": bf16 working copies (train.bf16_weights copies)."""
    train = dict(precision="bf16", bf16_weights="copies") if precision == "copies" else dict(precision=precision)
    cfg = tiny_config(parallel={"tp": 1, "pp": 1, "dp": 1, **parallel}, train=train)
    if family == "gpt2":
        cfg.model.family, cfg.model.n_kv_heads, cfg.model.n_positions = "gpt2", None, 64
    return cfg


def metered(cfg: Config, layers: list[int], first: bool, last: bool, b: int, mode: str) -> int:
    """Bytes the meter counts after one forward (and loss, on a last stage) of a real stage."""
    stage = build_stage(cfg.model, layers, first, last, 0, torch.device("cpu"))
    copies = cfg.train.bf16_weights == "copies"  # the stage's parameters and residual stream in bf16
    stage = stage.to(torch.bfloat16) if copies else stage
    stage.recompute = mode
    t, d = cfg.train.seq_len, cfg.model.dim
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (b, t), generator=g) if first else torch.randn(b, t, d, generator=g, requires_grad=True)
    x = x.to(torch.bfloat16).requires_grad_() if copies and not first else x
    meter = ActivationMeter()
    meter.reset(stage.parameters())
    bf16 = cfg.train.precision == "bf16" and not copies
    low = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with meter.measuring(), low:
        y = stage(x)
        if last:
            y = token_cross_entropy(y, torch.randint(0, 256, (b, t), generator=g), 1.0)
    live = meter.live
    del y
    return live


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_layer_formula_is_what_autograd_saves(family: str, precision: str, mode: str) -> None:
    """Two layers, 3 samples: exactly the meter's count (the layer formula, plus the rotary tables)."""
    cfg = small(family, precision)
    got = metered(cfg, [0, 1], False, False, 3, mode)
    casts = weight_casts(cfg, 2 if mode == "none" else 0, False)  # one forward: once, either way
    assert got == 2 * layer_saved(cfg, 3, mode) + step_saved(cfg, False, False, 3) + casts


def rebuild_check(tp_group: object = None, sp: bool = False) -> list[tuple]:
    """Two layers of each family (llama with grouped-query attention; norm weights not 1: a recipe that left them
    out would show), on this rank's `tp_group` (sequence-parallel with `sp`, re-gathering), each precision
    without and with train.rebuild_saved: (family, precision, gradients torch.equal, meter bytes (off, on),
    model bytes (off, on))."""
    n = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    out = []
    for family, precision in [(f, p) for f in ("llama", "gpt2") for p in ("fp32", "bf16")]:
        cfg = small(family, precision, tp=n, sequence_parallel=sp)
        grads, live, model = [], [], []
        for on in (False, True):
            cfg.train.rebuild_saved = on
            stage = build_stage(cfg.model, [0, 1], False, False, 0, torch.device("cpu"), tp_group, sp, "regather")
            stage.rebuild_now = on
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in stage.parameters():
                    p.add_(torch.randn(p.shape, generator=g), alpha=0.1)
            x = torch.randn(3, cfg.train.seq_len // (n if sp else 1), cfg.model.dim, generator=g, requires_grad=True)
            meter = ActivationMeter()
            meter.reset(stage.parameters())
            low = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
            with meter.measuring(), low:
                y = stage(x)
            live.append(meter.live)
            model.append(
                2 * layer_saved(cfg, 3, "none") + step_saved(cfg, False, False, 3) + weight_casts(cfg, 2, False)
            )
            y.backward(torch.randn(y.shape, generator=g))
            grads.append([x.grad] + [p.grad for p in stage.parameters()])
        same = all(torch.equal(a, b) for a, b in zip(*grads))
        out.append((family, precision, same, tuple(live), tuple(model)))
    return out


def test_rebuilt_saves_give_the_same_gradients_and_the_model_follows() -> None:
    """train.rebuild_saved (model/regather.py): bit for bit the gradients of keeping the tensors, and the meter's
    count exactly the layer formula's, with and without. tp2 with and without sequence parallelism:
    test_model_matches_what_ranks_hold's launch."""
    for family, precision, same, live, model in rebuild_check():
        assert same and live == model and live[1] < live[0], (family, precision, live, model)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_embedding_head_and_loss_are_what_autograd_saves(family: str, precision: str) -> None:
    cfg = small(family, precision)
    got = metered(cfg, [0], True, True, 2, "full")
    want = layer_saved(cfg, 2, "full") + ends_saved(cfg, 2, True, True) + step_saved(cfg, True, True, 2)
    want += weight_casts(cfg, 0, True)  # the head's
    assert got == want


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_zero_bubble_b_keeps_what_w_reads_until_w(family: str, precision: str, mode: str) -> None:
    """A split backward (B, then W later): after B the meter holds exactly what W reads, whatever the
    recomputation; after W nothing."""
    cfg = small(family, precision, schedule="zb-h1")
    stage = build_stage(cfg.model, [0, 1], False, True, 0, torch.device("cpu"))
    stage.recompute, stage.rebuild_now = mode, False  # as the runtime's split backward: W keeps the inputs anyway
    meter = ActivationMeter()
    meter.reset(stage.parameters())
    split = WeightGradDeferral(stage)
    split.meter = meter
    b, t = 3, cfg.train.seq_len
    x = torch.randn(b, t, cfg.model.dim, requires_grad=True)
    low = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    split.key = 0
    with meter.measuring(), low:
        y = token_cross_entropy(stage(x), torch.randint(0, 256, (b, t)), 1.0)
    split.key = None
    # Under autocast W's fp32 inputs (GPT-2's two norm outputs per layer, the head's) are held from F on;
    # llama's projections read the norms' shared bf16 casts, which autograd saves anyway.
    layers = 4 if mode == "none" and family == "gpt2" else 0
    early = (layers + 1) * b * t * cfg.model.dim * 4 if precision == "bf16" else 0
    saved = 2 * layer_saved(cfg, b, mode) + ends_saved(cfg, b, False, True) + step_saved(cfg, False, True, b)
    saved += weight_casts(cfg, 2 if mode == "none" else 0, True)
    assert meter.live == saved + early
    split.backward_input(y, None, x, 0)
    del y
    assert meter.live == weight_held(cfg, b, 2, True)
    split.weight(0)
    assert meter.live == 0


def test_working_copies_save_what_the_formulas_say() -> None:
    """bf16 working copies (no autocast, bf16 parameters and residual stream): two layers, an embedding with
    head and loss, and a zero-bubble split's B-to-W hold, each exactly the meter's count."""
    cfg = small("llama", "copies")
    rope = table_casts(cfg, True)  # once per microbatch and stage, shared by its layers
    assert metered(cfg, [0, 1], False, False, 3, "none") == 2 * layer_saved(cfg, 3, "none") + rope
    ends = ends_saved(cfg, 2, True, True) + step_saved(cfg, True, True, 2)
    assert metered(cfg, [0], True, True, 2, "none") == layer_saved(cfg, 2, "none") + ends + rope
    assert weight_casts(cfg, 2, True) == 0 and step_saved(cfg, False, False, 3) == 0
    stage = build_stage(cfg.model, [0, 1], False, True, 0, torch.device("cpu")).to(torch.bfloat16)
    stage.rebuild_now, cfg.parallel.schedule = False, "zb-h1"  # as the runtime's split backward: nothing rebuilt
    meter = ActivationMeter()
    meter.reset(stage.parameters())
    split = WeightGradDeferral(stage)
    split.meter, split.key = meter, 0
    b, t = 3, cfg.train.seq_len
    x = torch.randn(b, t, cfg.model.dim, dtype=torch.bfloat16, requires_grad=True)
    with meter.measuring():
        y = token_cross_entropy(stage(x), torch.randint(0, 256, (b, t)), 1.0)
    split.key = None
    saved = 2 * layer_saved(cfg, b, "none") + ends_saved(cfg, b, False, True) + step_saved(cfg, False, True, b)
    assert meter.live == saved + rope
    split.backward_input(y, None, x, 0)
    del y
    assert meter.live == weight_held(cfg, b, 2, True)


def _microbatches(cfg: Config, span: bool, n: int = 3) -> tuple[list[int], list[torch.Tensor]]:
    """n forwards of a whole two-layer bf16 model under the runtime's per-action autocast, then n backwards,
    inside one step (`span`: runtime.step_casts, as a training step) or not: the meter after each
    forward, and the gradients."""
    stage = build_stage(cfg.model, [0, 1], True, True, 0, torch.device("cpu"))
    meter = ActivationMeter()
    meter.reset(stage.parameters())
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (2, cfg.train.seq_len), generator=g) for _ in range(n)]
    losses, live = [], []
    with step_casts("cpu", torch.bfloat16, [stage], span):
        for x in xs:
            with meter.measuring(), torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(token_cross_entropy(stage(x), x, 1.0))
            live.append(meter.live)
        for loss in losses:
            loss.backward()
    return live, [p.grad for p in stage.parameters()]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_training_step_saves_one_bf16_copy_of_each_weight(family: str) -> None:
    """Per action autocast recasts every weight for each microbatch; inside step_casts the copies are made
    once and shared by every microbatch (bit-identical gradients), as weight_casts counts them."""
    cfg = small(family, "bf16")
    casts = weight_casts(cfg, 2, True)
    per_action, grads = _microbatches(cfg, span=False)
    spanned, spanned_grads = _microbatches(cfg, span=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, spanned_grads))
    one = per_action[1] - per_action[0]  # a microbatch's own saved tensors, its casts included
    assert per_action == [per_action[0] + k * one for k in range(3)]
    assert spanned == [per_action[0] + k * (one - casts) for k in range(3)]


def test_recomputation_keeps_less() -> None:
    for family in ("llama", "gpt2"):
        for precision in ("fp32", "bf16"):
            cfg = small(family, precision)
            full, sel, none = (layer_saved(cfg, 4, m) for m in MODES[1:] + MODES[:1])
            assert full < sel < none
            assert full == 4 * cfg.train.seq_len * cfg.model.dim * 4  # the layer's fp32 input only


def test_parameters_per_rank_follow_the_registry_with_virtual_stages() -> None:
    """Interleaved 1F1B, 2 chunks per rank: a rank holds stages r and r + pp; its bytes are those of
    every parameter the registry places on them."""
    cfg = small("llama", pp=2, schedule="interleaved-1f1b", virtual_stages=2)
    cfg.train.microbatches = 4
    shapes, stage_of = full_shapes(cfg.model), param_stages(cfg.model, layer_partition(cfg))
    est = rank_memory(cfg)
    for r in range(2):
        want = sum(shapes[n].numel() for n, s in stage_of.items() if s % 2 == r) * 4
        assert est[r].params == want == est[r].grads


def test_tied_embedding_is_one_tensor_on_one_stage_and_a_summed_copy_across_two() -> None:
    m = small("llama").model
    v_d = m.vocab_size * m.dim * 4
    untied, tied = small("llama"), small("llama")
    tied.model.tie_embeddings = True
    assert rank_memory(untied)[0].params - rank_memory(tied)[0].params == v_d
    untied.parallel.pp = tied.parallel.pp = 2
    a, b = rank_memory(untied), rank_memory(tied)
    assert [x.params for x in a] == [x.params for x in b]  # the last stage's head is a copy
    assert [y.buffers - x.buffers for x, y in zip(a, b)] == [v_d, v_d]  # the gradients' sum over pp


def test_zero1_holds_its_slices_moments() -> None:
    shapes = [((256, 32), None), ((32, 64), 0), ((64,), 0), ((5,), None), ((6, 2), None)]
    # rank 0 of dp 3: 85 rows and the 1 left over; 10 + 2 of the tp shard's rows; 21 + 1; 1 + 2; 2.
    parts = [86 * 32, 12 * 64, 22, 3, 2 * 2]
    assert optimizer_bytes(shapes, 3, 1) == sum(2 * 4 * n + 4 for n in parts)  # moments and step count
    assert [sum(slice_sizes(s, d, 3)) for s, d in shapes] == [torch.Size(s).numel() for s, _ in shapes]
    assert optimizer_bytes(shapes, 1, 0) == sum(2 * 4 * torch.Size(s).numel() + 4 for s, _ in shapes)


def test_gradient_buckets_all_reduce_a_flat_copy_and_reduce_scatter_in_place() -> None:
    shapes = [((5, 4), None), ((7,), 0), ((3, 2), None)]
    assert bucket_bytes([shapes], 1, 0) == 0  # no data parallelism, nothing to reduce
    assert bucket_bytes([shapes], 2, 0) == (20 + 7 + 6) * 4  # one flat copy of every gradient
    # context-parallel peers sum their gradients too (over dp x cp): at dp 1 a flat copy all the same, and
    # ZeRO (cut over dp) slices nothing there
    assert bucket_bytes([shapes], 1, 0, cp=2) == bucket_bytes([shapes], 1, 1, cp=2) == (20 + 7 + 6) * 4
    # ZeRO, dp 2 and 3: every tensor is sliced and reduce-scattered inside itself (odd rows included)
    big = [((1024, 1024), None), ((1023, 1024), 0)]  # 4 MiB each: two buckets
    assert bucket_bytes([shapes], 2, 1) == bucket_bytes([shapes, big], 3, 2) == 0


def slice_sizes(shape: tuple[int, ...], tp_dim: int | None, dp: int) -> list[int]:
    s = slice_of(torch.Size(shape), tp_dim, dp)
    if s.dim is None:
        return [0] * dp
    return [torch.Size(shape).numel() // shape[s.dim] * n for n in s.sizes]


def test_activations_follow_the_schedule() -> None:
    """1F1B on 2 ranks holds 2 microbatches on rank 0 and 1 on rank 1; GPipe holds all 4."""
    cfg = small("llama", pp=2)
    cfg.train.global_batch, cfg.train.microbatches = 8, 4
    parts = layer_partition(cfg)

    def per_mb(s: int) -> int:
        return len(parts[s]) * layer_saved(cfg, 2, "none") + ends_saved(cfg, 2, s == 0, s == 1)

    const = [step_saved(cfg, s == 0, s == 1, 8) for s in range(2)]
    assert [e.activations for e in rank_memory(cfg)] == [2 * per_mb(0) + const[0], per_mb(1) + const[1]]
    cfg.parallel.schedule = "gpipe"
    assert [e.activations for e in rank_memory(cfg)] == [4 * per_mb(s) + const[s] for s in range(2)]


@pytest.mark.parametrize("precision", ["fp32", "copies", "bf16"])
def test_a_message_read_in_place_from_its_buffer_is_counted_once(precision: str) -> None:
    """Through the process group (GPUs) a received activation read in place (fp32, or bf16 under working copies)
    is the receive buffer, which `buffers` counts: the activations leave it out (1F1B on 2 ranks: rank 1 holds
    one microbatch's). Over shared memory it is lent from the sender's ring (no receive buffer), and under
    autocast the stage reads an fp32 copy: the activations keep their count there."""
    cfg = small("llama", precision, pp=2)
    cfg.train.global_batch, cfg.train.microbatches = 8, 4
    cfg.parallel.p2p = "shared_memory"
    lent = rank_memory(cfg)
    cfg.parallel.p2p = "process_group"
    own = rank_memory(cfg)
    message = 2 * cfg.train.seq_len * cfg.model.dim * (4 if precision == "fp32" else 2)  # 2 samples
    assert own[0].activations == lent[0].activations  # the first stage receives no activation
    assert lent[1].activations - own[1].activations == (0 if precision == "bf16" else message)
    assert own[1].buffers >= message


def test_a_bad_configuration_is_named_before_anything_is_computed() -> None:
    with pytest.raises(ValueError, match="tp=3 does not divide model.n_heads=4"):
        rank_memory(small("llama", tp=3))


def test_stage_shapes_shard_by_the_plan() -> None:
    cfg = small("llama", tp=2)
    whole = {n: s for n, s in full_shapes(cfg.model).items()}
    got = stage_shapes(cfg, layer_partition(cfg), 0)
    assert sum(torch.Size(s).numel() for s, _ in got) * 2 > sum(s.numel() for s in whole.values())
    assert ((cfg.model.vocab_size // 2, cfg.model.dim), 0) in got  # the vocabulary-parallel embedding


def _held_worker(cfg_dicts: list[dict]) -> list[dict]:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    torch.set_num_threads(1)
    out, topos = [], {}
    for d in cfg_dicts:
        p = Config.from_dict(d).parallel
        if p.layout not in topos:  # one mesh per layout, the process group reused
            topos[p.layout] = build_topology(p.dp, p.pp, p.tp, "gloo", 60.0)
        topo = topos[p.layout]
        tr = Trainer(Config.from_dict(d), topo)
        losses = [tr.step(s)["loss"] for s in range(2)]
        tr.p2p.close()
        out.append({"pp": topo.pp_rank, "dp": topo.dp_rank, "losses": losses, **tr.memory})
    tp2 = next(t for t in topos.values() if t.dims.tp == 2)  # rebuilding at tp2, without and with SP
    out.append({"rebuild": [rebuild_check(tp2.group("tp"), sp) for sp in (False, True)]})
    return out


@pytest.mark.multiprocess
def test_model_matches_what_ranks_hold() -> None:
    """dp2 x pp2 on 11 samples (replicas of 6 and 5, unequal microbatches), GQA: 1F1B with ZeRO-1, bf16,
    selective recomputation on one stage and full on the other; and ZB-V (two stages per rank, B and W
    split), bf16 without recomputation; tp2 x pp2 with sequence parallelism under ZB-H1 and (re-gathering the
    projections' inputs in the backward) 1F1B in bf16. Every component of
    dp rank 0 (the larger share, which the model describes) within 10% of the model."""
    one_sample = dict(precision="bf16", global_batch=4, microbatches=4)
    sp = dict(tp=2, pp=2, dp=1, sequence_parallel=True)
    cfgs = [
        tiny_config(parallel=dict(tp=1, pp=2, dp=2, zero=1), train=dict(precision="bf16", recompute="selective,full")),
        tiny_config(parallel=dict(tp=1, pp=2, dp=2, schedule="zb-v"), train=dict(microbatches=4, precision="bf16")),
        # sequence parallelism at tp2 x pp2 under the B/W split: the norm regions and messages at 1/tp
        tiny_config(parallel=dict(tp=2, pp=2, dp=1, schedule="zb-h1", sequence_parallel=True)),
        # and under 1F1B in bf16, where the projections keep the 1/tp slice of their gathered input (sp_backward),
        # beside the same run keeping the gathered input itself (microbatches of one sample: the slice kept must be
        # a copy, not a view that holds the whole); messages through the process group, as on GPUs: a bf16
        # activation's receive buffer goes back after the forward that widened it (no gradient buckets here:
        # the buffers are the messages alone, counted exactly)
        tiny_config(parallel=dict(sp, p2p="process_group"), train=one_sample),
        tiny_config(parallel=dict(sp, p2p="process_group", sp_backward="saved"), train=one_sample),
        # bf16 working copies under ZeRO-1: bf16 parameters, fp32 gradients, fp32 masters and moments of the
        # slice, bf16 activations and messages; counted exactly
        tiny_config(parallel=dict(tp=1, pp=2, dp=2, zero=1), train=dict(precision="bf16", bf16_weights="copies")),
        # and through the process group: the received bf16 activation, read in place, is its receive buffer,
        # counted there and not again in the activations; counted exactly (equal microbatches: the runtime pools
        # released buffers by shape, which the replay does not, so unequal ones would hold one more)
        tiny_config(
            parallel=dict(tp=1, pp=2, dp=2, p2p="process_group"),
            train=dict(precision="bf16", bf16_weights="copies", global_batch=8),
        ),
        # and under ZB-H1 in fp32: a received gradient read in place is held by its W, an activation by its B, and
        # each buffer goes with its last reader (one message more at pipeline rank 0 while the P2P's bookkeeping
        # held them: P2P._forget); recomputing, B's high point is its first layer's rerun, the last stage's
        # targets already freed (counted there until 2026-12-07); counted exactly
        tiny_config(
            parallel=dict(tp=1, pp=2, dp=2, p2p="process_group", schedule="zb-h1"),
            train=dict(global_batch=8, recompute="full"),
        ),
    ]
    got = run_ranks(_held_worker, 4, [c.to_dict() for c in cfgs], timeout_s=300)
    for ranks in got:  # train.rebuild_saved at tp2: bit for bit the same gradients, the meter the model exactly
        for sp, checks in zip((False, True), ranks[-1]["rebuild"]):
            for family, precision, same, live, model in checks:
                assert same and live == model and live[1] < live[0], (sp, family, precision, live, model)
    # The re-gather copies the forward's values: the same losses bit for bit (the second step's after an update
    # from the first's gradients), and the activations lower by the model's difference (the projections' inputs).
    for ranks in got:
        regather, saved = ranks[3], ranks[4]
        assert regather["losses"] == saved["losses"] and regather["losses"][0] is not None
        less = rank_memory(cfgs[4])[regather["pp"]].activations - rank_memory(cfgs[3])[regather["pp"]].activations
        assert less > 0 and saved["activations"] - regather["activations"] == less, (regather, saved, less)
        for r, cfg in ((regather, cfgs[3]), (saved, cfgs[4])):
            assert r["buffers"] == rank_memory(cfg)[r["pp"]].buffers, r
    for i, cfg in enumerate(cfgs):
        est = rank_memory(cfg)
        for r in (ranks[i] for ranks in got):
            if r["dp"] != 0:
                continue
            e = est[r["pp"]]
            for k in ("params", "grads", "optimizer", "activations", "buffers"):
                assert abs(getattr(e, k) - r[k]) <= 0.10 * r[k], (i, r["pp"], k, getattr(e, k), r[k])
                assert i < 5 or getattr(e, k) == r[k], (i, r["pp"], k, getattr(e, k), r[k])


def test_bench_grid_skips_zero_without_data_parallelism_and_refuses_unknown_names() -> None:
    from hybridpar.bench.memory_accuracy import cases, parse_args

    runs, skipped = cases(["default", "larger"], ["tp2xpp2", "dp2xpp2"], 2)
    assert (len(runs["tp2xpp2"]), len(runs["dp2xpp2"]), len(skipped)) == (12, 24, 12)
    assert all("zero=1" in s and "tp2xpp2" in s for s in skipped)
    runs, skipped = cases(["default"], ["dp4", "tp2xpp2"], 2, zeros=(0, 3), precisions=("fp32",))
    assert (len(runs["dp4"]), len(runs["tp2xpp2"]), len(skipped)) == (6, 3, 3)
    assert all("ZeRO-3 shards over dp" in s for s in skipped)
    bad_args = (["--models", "huge"], ["--layouts", "tp3"], ["--steps", "0"], ["--zero", "4"], ["--precisions", "fp16"])
    for bad in bad_args:
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2
