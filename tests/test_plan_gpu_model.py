"""The GPU calibration (plan/gpu_model.py): the GEMM efficiency curve is monotone and bounded, the table is
refused with one line naming its key, a GPU file without it plans on the datasheet figures with one line
saying so, the CPU path is the datasheet/probe path as before, and published rows are predicted leave-one-out."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib

from hybridpar.bench import published_compare as pc
from hybridpar.config import Config
from hybridpar.model.registry import layer_flops_per_token
from hybridpar.plan.collectives import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s
from hybridpar.plan.cost import CostModel, placement
from hybridpar.plan.gpu_model import (
    FLASH_BACKWARD_RECOMPUTE,
    OVERLAPS,
    Rates,
    accumulation_bytes,
    exposed_tp_comm,
    grad_bytes,
    parse_gpu_calibration,
    weight_gemms,
)
from hybridpar.plan.hardware import load_hardware, parse_hardware
from hybridpar.plan.main import calibration_note
from hybridpar.plan.published import PLANNER_DOCS, load_runs, row_config
from hybridpar.plan.step import grad_reduce_s, handoff, predict, stage_costs
from tests.test_plan_hardware import good
from tests.test_published_compare import weights_only

ROOT = Path(__file__).parents[1]
A100 = load_hardware(ROOT / "docs" / "hardware" / "dgx-a100-80gb.toml")
RUNS = load_runs()


def table() -> dict:
    return {
        "matmul_fraction": 0.8,
        "memory_fraction": 0.85,
        "attention_fraction": 0.5,
        "intra_bus_fraction": 0.8,
        "inter_bus_fraction": 0.9,
        "attention_kernel": "flash",
        "source": "a test",
        "date": "2026-12-06",
    }


def test_gemm_efficiency_is_monotone_in_each_dimension_and_bounded() -> None:
    """A GEMM's rate is matmul_fraction of the peak times its efficiency: never above the measured best."""
    for precision in ("bf16", "fp32"):
        rates = A100.gpu_rates(precision)
        dims = [1, 8, 64, 96, 128, 512, 2048, 8192, 65536]
        for m, n, k in itertools.product(dims, repeat=3):
            e = rates.matmul_efficiency(m, n, k)
            assert 0 < e <= 1
            for bigger in ((m * 2, n, k), (m, n * 2, k), (m, n, k * 2)):
                assert rates.matmul_efficiency(*bigger) >= e * (1 - 1e-12)
    rates = A100.gpu_rates("bf16")
    assert rates.matmul_efficiency(8192, 8192, 8192) == 1.0  # large GEMMs: the measured best
    assert rates.matmul_efficiency(2048, 2048, 96) < 1.0  # attention's per-head product: less


def test_gemm_time_is_its_flops_at_the_efficiency() -> None:
    r = Rates(flops=100e12, memory_bps=1e12, elem_bytes=2)
    assert r.gemm_s(4096, 4096, 4096) == pytest.approx(2 * 4096**3 / 100e12)
    assert r.gemm_s(4096, 4096, 1) == pytest.approx(2 * 4096 * 4096 * 2 * (1 + 2 / 4096) / 1e12 / 2)
    assert r.gemm_s(0, 10, 10) == 0.0


@pytest.mark.parametrize(
    "change, words",
    [
        ({"matmul_fraction": 1.2}, "matmul_fraction must be a fraction in (0, 1]"),
        ({"memory_fraction": 0}, "memory_fraction must be a fraction in (0, 1]"),
        ({"attention_kernel": "paged"}, "attention_kernel must be one of flash, unfused"),
        ({"source": " "}, "source must be a non-empty string"),
        ({"extra": 1}, "needs exactly the keys"),
        ({"overlap": ["dp"]}, "overlap must be a list of distinct names from tp_comm, grad_reduce, param_gather"),
        ({"overlap": ["tp_comm", "tp_comm"]}, "overlap must be a list of distinct names"),
        ({"sp_backward": "gather"}, "sp_backward must be one of saved, regather"),
        ({"cp_comm": "all-to-all"}, "cp_comm must be one of ring, allgather"),
        ({"grad_accumulation": "fp32"}, "grad_accumulation must be one of fused, separate, separate-half"),
        ({"p2p": "nonblocking"}, "p2p must be one of async, blocking"),
        ({"tp_comm_efficiency": 1.5}, "tp_comm_efficiency must be a number from -4 to 1"),
        ({"tp_comm_efficiency": "high"}, "tp_comm_efficiency must be a number from -4 to 1"),
        ({"kernel_floor_us": -1.0}, "kernel_floor_us must be microseconds from 0 (none) to 1000, got -1.0"),
        ({"dispatch_us": 5e3}, "dispatch_us must be microseconds from 0 (none) to 1000, got 5000.0"),
        ({"dispatch_us": "5"}, "dispatch_us must be microseconds"),
    ],
)
def test_a_bad_table_is_refused_in_one_line_naming_the_key(change: dict, words: str) -> None:
    d = good() | {"gpu_calibration": table() | change}
    with pytest.raises(ValueError) as e:
        parse_hardware(d, "hardware file 'x.toml'")
    assert words in str(e.value) and "\n" not in str(e.value) and "x.toml" in str(e.value)


def test_a_gpu_file_without_the_table_plans_on_datasheet_figures_and_says_so_in_one_line() -> None:
    bare = replace(A100, gpu_calibration=None)
    note = calibration_note(bare)
    assert note is not None and "\n" not in note and "no [gpu_calibration]" in note and A100.name in note
    assert calibration_note(A100) is None
    assert calibration_note(replace(bare, cores_per_node=2.0)) is None  # a CPU host: its probe's numbers
    cfg = Config()
    cfg.train.precision = "bf16"
    t, m = cfg.train, cfg.model
    lay = CostModel(m, bare).layer(t, 1, 1024, bare.intra_node, "none")
    assert lay.f.matmul_s == 1024 * layer_flops_per_token(m, t.seq_len) / 1 / bare.peak_flops("bf16")  # as before
    slower = CostModel(m, A100).layer(t, 1, 1024, A100.intra_node, "none")
    assert slower.f.matmul_s > lay.f.matmul_s and slower.f.memory_s > lay.f.memory_s


def test_calibration_makes_a_published_row_slower_not_faster() -> None:
    row = next(r for r in RUNS if r["id"] == "korthikanti-gpt-175b-a100")
    cfg, hw = row_config(row), load_hardware(PLANNER_DOCS / row["cluster"])
    calibrated = predict(CostModel(cfg.model, hw), cfg).step_s
    datasheet = predict(CostModel(cfg.model, replace(hw, gpu_calibration=None)), cfg).step_s
    assert calibrated > 1.1 * datasheet


@pytest.mark.parametrize("row_id", ["korthikanti-gpt-22b-a100", "mcore-gpt-70b-h100"])
def test_a_rows_prediction_does_not_see_its_published_figure(row_id: str) -> None:
    """Leave-one-out: no cost-model parameter comes from the rows, so changing a row's published figures
    leaves its prediction (and every other row's) as it was."""
    row = next(r for r in RUNS if r["id"] == row_id)
    other = {k: v * 3 for k, v in row.items() if k.startswith("reported_")}
    a = pc.compare(row, memory=weights_only, search=False)
    b = pc.compare(row | other, memory=weights_only, search=False)
    assert a["predicted_tokens_per_s_per_gpu"] == b["predicted_tokens_per_s_per_gpu"]
    change = pc.ratio(b) / pc.ratio(a)  # the published figure moved, tripled (a rate) or a third (a step time)
    assert change == pytest.approx(1 / 3) or change == pytest.approx(3)


def _docs_table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "planner.md").read_text()
    start = text.index("| run | unit | published | predicted | ratio |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


def test_the_accuracy_table_in_the_docs_is_what_the_code_computes() -> None:
    """Every row of docs/planner.md's accuracy table is a published row, and each row whose published layout
    has at most 16 stages (the deep pipelines take seconds each to simulate) reads as computed now; the
    summary line is that of the table's own ratios."""
    doc = _docs_table()
    assert set(doc) == {r["id"] for r in RUNS}
    for row in RUNS:
        if row["pp"] > 16:
            continue
        out = pc.compare(row, memory=weights_only, search=False)
        line = pc.accuracy([out]).splitlines()[2]
        assert [c.strip() for c in line.strip("|").split("|")][:5] == doc[row["id"]][:5], row["id"]
    ratios = sorted(float(cells[4]) for cells in doc.values())
    text = (ROOT / "docs" / "planner.md").read_text()
    summary = re.search(r"(\d+) rows: ratio median ([\d.]+), range ([\d.]+)-([\d.]+)", text)
    assert summary is not None and int(summary[1]) == len(ratios)
    assert float(summary[3]) == ratios[0] and float(summary[4]) == ratios[-1]
    n = len(ratios)
    assert abs(float(summary[2]) - (ratios[(n - 1) // 2] + ratios[n // 2]) / 2) <= 0.01


def test_every_calibration_names_its_source_and_date() -> None:
    files = sorted((ROOT / "docs" / "hardware").glob("*.toml")) + sorted((PLANNER_DOCS / "clusters").glob("*.toml"))
    for path in files:
        g = load_hardware(path).gpu_calibration
        assert g is not None, path
        for key in ("matmul_fraction", "memory_fraction", "intra_bus_fraction", "inter_bus_fraction"):
            assert key in g.source, (path, key)
        assert re.search(r"20\d\d", g.date)
        # The per-kernel figures come from `plan --probe` on the device only: no file here invents them.
        assert (g.kernel_floor_us, g.dispatch_us) == (0.0, 0.0), path
    parse_gpu_calibration(table(), "t")  # the test's own table is a good one


H100 = load_hardware(PLANNER_DOCS / "clusters" / "dgx-h100-ndr.toml")


def test_each_overlap_hides_only_the_term_it_names() -> None:
    """The H100 clusters' software overlaps three collectives with compute (gpu_model.OVERLAPS): each alone
    shortens the step through its own breakdown term only, and none makes a step longer."""
    cfg = Config.from_dict(
        {
            "model": {"dim": 1024, "n_layers": 4, "n_heads": 16, "ffn_dim": 4096, "vocab_size": 1024},
            "parallel": {"tp": 8, "pp": 2, "dp": 4, "zero": 1},
            "train": {"global_batch": 16, "microbatches": 2, "seq_len": 1024, "precision": "bf16"},
        }
    )
    assert set(H100.gpu_calibration.overlap) == set(OVERLAPS)
    on = lambda names: replace(H100, gpu_calibration=replace(H100.gpu_calibration, overlap=names))  # noqa: E731
    none = predict(CostModel(cfg.model, on(())), cfg).breakdown()
    term = {"tp_comm": "tp_comm_s", "grad_reduce": "dp_reduce_s", "param_gather": "optimizer_s"}
    for name in OVERLAPS:
        one = predict(CostModel(cfg.model, on((name,))), cfg).breakdown()
        assert one[term[name]] < none[term[name]] and one["step_s"] < none["step_s"], name
        for other in set(term.values()) - {term[name], "tp_comm_s"}:  # tp's change moves the pipeline's timing
            assert one[other] == pytest.approx(none[other]) or name == "tp_comm", (name, other)
    toml = on(OVERLAPS).gpu_calibration.to_toml()
    assert 'overlap = ["tp_comm", "grad_reduce", "param_gather"]' in toml
    assert parse_gpu_calibration(tomllib.loads(toml)["gpu_calibration"], "x") == on(OVERLAPS).gpu_calibration


def test_nccl_takes_the_tree_for_small_all_reduces_and_zero_reduce_scatters() -> None:
    """On a GPU a step's small all-reduces over thousands of ranks take 2 log2 n hops (NCCL's tree), not the
    ring's 2 (n - 1); under ZeRO-1 a gradient reduction is a reduce-scatter, half an all-reduce's bytes. A CPU
    host keeps the ring and the all-reduce (its probe measured those)."""
    link, hop = H100.inter_node, H100.inter_node.latency_us * 1e-6
    assert all_reduce_s(8, 16384, link, H100) == pytest.approx(2 * 14 * hop, rel=1e-3)
    cpu = replace(H100, gpu_calibration=None)
    assert all_reduce_s(8, 16384, link, cpu) == pytest.approx(2 * 16383 * hop, rel=1e-3)
    big = 4e9  # large messages: the ring, on either
    assert all_reduce_s(big, 64, link, H100) == pytest.approx(2 * 63 * (hop + big / 64 / H100.link_bps(link)))
    assert grad_reduce_s(H100, big, 64, link, 1) == all_gather_s(big, 64, link, H100)
    assert grad_reduce_s(H100, big, 64, link, 0) == all_reduce_s(big, 64, link, H100)
    assert grad_reduce_s(cpu, big, 64, link, 1) == all_reduce_s(big, 64, link, cpu)


def test_end_chunks_hold_the_embedding_and_the_head_alone() -> None:
    """Llama 3's partition (bench EndChunks): the first chunk only the embedding, the last only the head, the
    layers evenly between; more chunks than that can fill are refused, and the ends' chunks cost only their
    ends (the first chunk's forward is the embedding's, far below a layer's)."""
    cfg = Config.from_dict(
        {
            "model": {"family": "llama", "dim": 512, "n_layers": 6, "n_heads": 8, "ffn_dim": 1024, "vocab_size": 512},
            "parallel": {"tp": 2, "pp": 2, "dp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 4},
            "train": {"global_batch": 4, "microbatches": 4, "seq_len": 256, "precision": "bf16"},
        }
    )
    model = pc.EndChunks(cfg.model, H100)
    pl = placement(cfg.parallel, H100)
    parts = model.parts(cfg, pl)
    assert [(r.start, r.stop) for r in parts] == [(0, 0)] + [(i, i + 1) for i in range(6)] + [(6, 6)]
    costs = stage_costs(model, cfg, pl, parts, 256)
    assert costs[0].f.total < costs[1].f.total / 4 and costs[-1].f.total > 0
    cfg.parallel.virtual_stages = 5  # 10 chunks around 6 layers: two would hold nothing
    with pytest.raises(ValueError, match="10 chunks cannot hold the embedding and the head apart around 6 layers"):
        model.parts(cfg, pl)


def test_a_regathering_backward_adds_two_all_gathers_under_sequence_parallelism_only() -> None:
    """Megatron keeps a column-parallel layer's 1/tp input slice under sequence parallelism and gathers it
    again for the weight gradient (gpu_model.SP_BACKWARDS): two all-gathers of the layer's input per
    backward, in B, or in W where the schedule splits the backward; nothing without sequence parallelism, and
    hybridpar's own runtime ("saved") keeps the gathered input."""
    cfg = Config.from_dict({"train": {"precision": "bf16", "seq_len": 256}})
    t, m = cfg.train, cfg.model
    g = replace(A100.gpu_calibration, sp_backward="regather")
    hw = replace(A100, gpu_calibration=g)
    gathers = 2 * all_gather_s(1024 * m.dim * 2, 4, hw.intra_node, hw)
    saved, again = CostModel(m, A100), CostModel(m, hw)
    for split in (False, True):
        a = saved.layer(t, 4, 1024, A100.intra_node, "none", split, sp=True)
        b = again.layer(t, 4, 1024, hw.intra_node, "none", split, sp=True)
        assert b.f == a.f
        assert (b.w if split else b.b).comm_s == pytest.approx((a.w if split else a.b).comm_s + gathers)
        assert (b.b if split else b.w) == (a.b if split else a.w)
        no_sp = again.layer(t, 4, 1024, hw.intra_node, "none", split, sp=False)
        assert no_sp == saved.layer(t, 4, 1024, A100.intra_node, "none", split, sp=False)
    assert 'sp_backward = "regather"' in g.to_toml() and "sp_backward" not in A100.gpu_calibration.to_toml()


def test_an_overlapped_collective_hides_only_behind_the_gemm_beside_it() -> None:
    """`tp_comm` (Transformer Engine's pairing): each collective is exposed by what it outlasts its own GEMM,
    not the pass's GEMMs together: at tp 8 and width 8192 the attention output's GEMM is shorter than a
    gather, so the forward exposes the difference though the pass's GEMMs together are far longer."""
    m = Config.from_dict({"model": {"dim": 8192, "n_heads": 64, "ffn_dim": 32768}}).model
    rates, link = H100.gpu_rates("bf16"), H100.intra_node
    tokens = 4096
    gather = all_gather_s(tokens * m.dim * 2, 8, link, H100)
    reduce = all_reduce_s(tokens * m.dim * 2, 8, link, H100)
    qkv, proj, up, down = (rates.gemm_s(tokens, n, k) for k, n in weight_gemms(m, 8))
    assert proj < gather < qkv + proj + up + down
    left = lambda g, c=gather: max(0.0, c - g)  # noqa: E731
    f, b, again = exposed_tp_comm(rates, m, 8, tokens, gather, reduce, sp=True, again=True)
    assert f == pytest.approx(left(qkv) + left(proj) + left(up) + left(down)) and f > 0
    assert b == pytest.approx(f) and again == pytest.approx(left(qkv) + left(up))
    f, b, again = exposed_tp_comm(rates, m, 8, tokens, gather, reduce, sp=False, again=True)
    assert f == pytest.approx(left(proj, reduce) + left(down, reduce)) and again == 0.0
    assert b == pytest.approx(left(qkv, reduce) + left(up, reduce))
    assert exposed_tp_comm(rates, m, 8, tokens, 1e-9, 2e-9, sp=True, again=True) == (0.0, 0.0, 0.0)
    # tp_comm_efficiency: at least (1 - E) of each collective stays exposed, whatever its GEMM; 1 is the above,
    # 0 exposes each whole, below 0 more than whole (the pair slower than the two one after the other).
    for eff in (1.0, 0.2, 0.0, -0.4):
        f, b, again = exposed_tp_comm(rates, m, 8, tokens, gather, reduce, sp=True, again=True, efficiency=eff)
        least = lambda g: max(left(g), (1 - eff) * gather)  # noqa: E731
        assert f == pytest.approx(least(qkv) + least(proj) + least(up) + least(down)), eff
        assert again == pytest.approx(least(qkv) + least(up)), eff
    assert f > 4 * gather and exposed_tp_comm(rates, m, 8, tokens, 1e-9, 2e-9, True, True, 0.0)[0] == 4e-9


def test_a_flash_backward_recomputes_its_scores_and_an_unfused_one_does_not() -> None:
    """FlashAttention's backward is 2.5 forwards of attention FLOPs (its benchmark's count, in which
    attention_fraction is a forward + backward rate): B takes half the attention's forward beyond twice the
    forward's matmuls; an unfused kernel's backward is twice its forward's GEMMs."""
    cfg = Config.from_dict({"train": {"precision": "bf16", "seq_len": 2048}})
    t, m = cfg.train, cfg.model
    rates = H100.gpu_rates("bf16")
    projections = sum(rates.gemm_s(4096, n, k) for k, n in weight_gemms(m, 2))
    for kernel, extra in (("flash", FLASH_BACKWARD_RECOMPUTE), ("unfused", 0.0)):
        hw = replace(H100, gpu_calibration=replace(H100.gpu_calibration, attention_kernel=kernel))
        lay = CostModel(m, hw).layer(t, 2, 4096, hw.intra_node, "none", split=True)
        assert lay.b.matmul_s == pytest.approx(lay.f.matmul_s + extra * (lay.f.matmul_s - projections)), kernel
        assert lay.w.matmul_s == lay.f.matmul_s
    assert FLASH_BACKWARD_RECOMPUTE == 0.5


def test_gathered_context_parallelism_and_separate_accumulation_cost_what_they_move() -> None:
    """`cp_comm = "allgather"` (Llama 3): the whole sequence's keys and values gathered in the forward and
    their gradients reduce-scattered in the backward, nothing hidden; `grad_accumulation = "separate"`: a pass
    of 10 bytes per parameter over the rank's weight gradients per microbatch, in W (or B where the backward
    is not split), the embedding's and the head's too; "separate-half" (an fp16 buffer): 6 bytes, and the
    data-parallel reduction moves 2 bytes a parameter instead of 4. Nothing moves where not named."""
    cfg = Config.from_dict(
        {"model": {"family": "llama", "n_kv_heads": 2}, "train": {"precision": "bf16", "seq_len": 4096}}
    )
    t, m, link = cfg.train, cfg.model, H100.inter_node
    g = H100.gpu_calibration
    assert (g.cp_comm, g.grad_accumulation) == ("ring", "fused")
    hw = replace(H100, gpu_calibration=replace(g, cp_comm="allgather", grad_accumulation="separate"))
    tokens, cp, tp = 1024, 4, 2
    whole = 2 * tokens * cp * m.kv_heads * m.head_dim / tp * 2
    assert CostModel(m, hw).ring_s(t, tp, tokens, (cp, link), 1.0) == (
        all_gather_s(whole, cp, link, hw),
        reduce_scatter_s(whole, cp, link, hw),
    )
    assert CostModel(m, H100).ring_s(t, tp, tokens, (cp, link), 1.0)[0] == 0.0  # the ring hides its hops
    base, sep = CostModel(m, H100), CostModel(m, hw)
    acc = (2 + 4 + 4) * base.counts.layer / tp / hw.memory_bps()  # the bf16 gradient, the fp32 sum
    for split in (True, False):
        a = base.layer(t, tp, tokens, link, "none", split)
        b = sep.layer(t, tp, tokens, link, "none", split)
        assert b.f == a.f
        assert (b.w if split else b.b).memory_s == pytest.approx((a.w if split else a.b).memory_s + acc)
    (e0, h0), (e1, h1) = base.ends(t, tp, tokens, link), sep.ends(t, tp, tokens, link)
    assert e1.memory_s == pytest.approx(e0.memory_s + acc * base.counts.embed / base.counts.layer)
    assert h1.memory_s > h0.memory_s
    toml = hw.gpu_calibration.to_toml()
    assert 'cp_comm = "allgather"' in toml and 'grad_accumulation = "separate"' in toml
    assert "cp_comm" not in g.to_toml()
    half = replace(g, grad_accumulation="separate-half")  # summed and reduced in the compute precision
    assert accumulation_bytes(half, 2) == 6 and grad_bytes(half, 2) == 2
    assert accumulation_bytes(hw.gpu_calibration, 2) == 10 and grad_bytes(hw.gpu_calibration, 2) == 4
    assert accumulation_bytes(g, 2) == 0 and grad_bytes(g, 2) == grad_bytes(None, 2) == 4
    model = {"dim": 2048, "ffn_dim": 8192}
    dp = Config.from_dict({"model": model, "parallel": {"dp": 8}, "train": {"precision": "bf16", "global_batch": 8}})
    after = lambda c: replace(H100, gpu_calibration=replace(c, overlap=()))  # noqa: E731  (reduced after the pipeline)
    reduce = lambda c: predict(CostModel(dp.model, after(c)), dp).dp_reduce_s  # noqa: E731
    assert 0 < reduce(half) < 0.6 * reduce(g)


def test_a_blocking_pipeline_sends_its_tp_slice_and_waits_for_it() -> None:
    """`p2p = "blocking"` (Megatron-LM's and DeepSpeed's pipelines of 2021-2022): each tp rank puts its 1/tp
    slice on the pipeline's link, the receiving stage all-gathers it, and the sender waits for its transfer;
    under sequence parallelism the message is a slice already and is sent whole. "async" (the default) keeps
    the whole message, posted and left to complete."""
    cfg = Config.from_dict({"parallel": {"tp": 8, "pp": 4, "dp": 1}})
    p, msg = cfg.parallel, 8 * 2**20
    hw = replace(A100, gpu_calibration=replace(A100.gpu_calibration, p2p="blocking"))
    pl = placement(p, hw)
    assert A100.gpu_calibration.p2p == "async" and handoff(A100, p, pl, msg) == (msg, 0.0, 0.0)
    assert handoff(hw, p, pl, msg) == (msg // 8, all_gather_s(msg, 8, pl.tp, hw), p2p_s(msg // 8, pl.pp, hw))
    p.sequence_parallel = True
    assert handoff(hw, p, pl, msg) == (msg, 0.0, p2p_s(msg, pl.pp, hw))
    p.pp, p.dp = 1, 4
    assert handoff(hw, p, placement(p, hw), msg) == (msg, 0.0, 0.0)  # no pipeline, no hand-off
    assert 'p2p = "blocking"' in hw.gpu_calibration.to_toml()
