"""Every parallel layout trains the same model as one device, against a plain single-process run
(torch.optim.AdamW, torch's clip): the loss of every step within 1e-5 of the fp32 run's, and every
parameter after 3 AdamW steps no farther from an fp64 run than the fp32 run is (DESIGN.md,
tests/references.py: `check_fp64`). Llama and GPT-2 over the grid of layouts and schedules, and odd shapes: tp=3, pp=3,
dp=3 with replicas of 4, 3 and 3 samples, a sequence of 33 tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hybridpar.config import Config, ModelConfig
from hybridpar.model.reference import TOL, gpt2_config, odd_config, tiny_config
from hybridpar.model.registry import build_full_model
from hybridpar.pipeline.schedules import schedule_spec, stages_per_rank
from hybridpar.topology.spawn import run_ranks
from tests.references import check_fp64, computing, ref_for

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def final_state(run_dir: Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    """A finished run's final/ (a Hugging Face directory) as our full state dict, in definition order."""
    from hybridpar.model.hf import SafetensorsDir
    from hybridpar.model.registry import load_stage_

    full = build_full_model(model, 0)
    load_stage_(full, SafetensorsDir(Path(run_dir) / "final"), hf_layout=True)
    return {n: p.detach() for n, p in full.named_parameters()}


def _worker(cfg_dicts: list[dict], out_dir: str, first: int = 0) -> list[tuple[list, list]]:
    """Each config's run in turn, as run{first + i} with its final state in state{first + i}.pt."""
    from hybridpar.run.train import train

    all_losses = []
    for i, d in enumerate(cfg_dicts, start=first):
        cfg = Config.from_dict(d)
        cfg.run_dir = str(Path(out_dir) / f"run{i}")  # one run per directory
        res = train(cfg, log=False)
        if res.state is not None:
            torch.save(res.state, Path(out_dir) / f"state{i}.pt")
        all_losses.append((res.losses, res.val_losses))
    return all_losses


def _tight_rings_worker(cfg_dicts: list[dict], out_dir: str, first: int = 0) -> list[tuple[list, list]]:
    """_worker with shared-memory rings of 4 messages at first: they wrap and grow all the time, so
    a message released while something still reads it would be overwritten (and the result wrong)."""
    from hybridpar.pipeline import shm

    shm._MIN_CAPACITY = 0
    return _worker(cfg_dicts, out_dir, first)


def _shared_worker(cfg_dicts: list[dict], out_dir: str, tight: int) -> list[tuple[list, list]]:
    """_worker, the last `tight` configs over tight rings: after the others, since the setting stays for
    the rest of the process."""
    n = len(cfg_dicts) - tight
    return _worker(cfg_dicts[:n], out_dir) + (_tight_rings_worker(cfg_dicts[n:], out_dir, n) if tight else [])


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


def run_layouts(cfgs: list[Config], out: Path, worker=_worker) -> list[tuple[list, list]]:
    """Each config's run (all of one world size, in one launch, in order): rank 0's (losses, validation
    losses) per config, and its final state in out/state{i}.pt."""
    world = cfgs[0].parallel.world_size
    with computing(cfgs):  # the references, while the ranks run
        return run_ranks(worker, world, [c.to_dict() for c in cfgs], str(out), timeout_s=400)[0]


def check_results(cfgs: list[Config], results: list, out: Path, first: int = 0) -> None:
    """Runs of `cfgs` (results[i], out/state{first + i}.pt) against the single-device reference: the loss
    of every step and every validation within TOL, every parameter by the fp64 criterion."""
    for i, cfg in enumerate(cfgs):
        ref_losses, ref_val, ref_state = ref_for(cfg)
        p = cfg.parallel
        cp = f" cp={p.cp}" if p.cp > 1 else ""
        label = f"tp={p.tp} pp={p.pp} dp={p.dp}{cp} {p.schedule} v={stages_per_rank(p)} m={cfg.train.microbatches}"
        losses, val = results[i]
        assert len(losses) == len(ref_losses) and len(val) == len(ref_val) == 2
        for (s, a), (_, b) in zip(val, ref_val):
            assert abs(a - b) <= TOL, f"{label}: validation loss after step {s}: {a} vs single device {b}"
        for s, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= TOL, f"{label}: step {s} loss {a} vs single device {b}"
        state = torch.load(out / f"state{first + i}.pt", weights_only=True)
        assert list(state) == list(ref_state), f"{label}: parameter names/order differ"
        check_fp64(label, state, cfg)


def check_layouts(cfgs: list[Config], tmp_path: Path, worker=_worker) -> None:
    """Each config's run (all of one world size, in one launch) against the single-device reference."""
    check_results(cfgs, run_layouts(cfgs, tmp_path, worker), tmp_path)


def layout_configs(tp: int, pp: int, dp: int) -> list[Config]:
    return [grid_config(pp, s, v, parallel=dict(tp=tp, pp=pp, dp=dp)) for s, v in schedules_for(pp)]


GPT2_LAYOUTS = [(2, 2, 1), (1, 2, 2), (2, 1, 2)]


def gpt2_configs(tp: int, pp: int, dp: int) -> list[Config]:
    return [gpt2_config(tp=tp, pp=pp, dp=dp, schedule=s, virtual_stages=v) for s, v in schedules_for(pp)]


def tied_configs() -> list[Config]:
    return [
        tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=2, pp=2, dp=1, schedule="1f1b")),
        tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=1, pp=2, dp=2, schedule="gpipe")),
        tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=2, pp=1, dp=2, schedule="1f1b")),
        # zb-v: the embedding and the head it is tied to are two stages of rank 0
        tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=2, pp=2, dp=1, schedule="zb-v")),
    ]


def unequal_configs() -> list[Config]:
    cfg = tiny_config(
        parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b"), train=dict(global_batch=10, microbatch_sizes=[4, 1, 2, 3])
    )
    return [cfg]


def compile_configs() -> list[Config]:
    """train.compile (aot_eager: the capture, graph breaks and compiled backward without code generation) with
    the zero-bubble B/W split and selective recomputation over two stages (microbatches of 3 and 2 samples in
    flight together), with tensor parallelism's collectives traced into the graph, with ZeRO-3's parameters
    gathered around each layer and freed after it (its hooks eager beside the graph), and with context
    parallelism (ring attention eager between the layer's graphs). Inductor's kernels: `hybridpar bench
    compile`."""
    c = dict(compile=True, compile_backend="aot_eager")
    return [
        grid_config(2, "zb-h1", 1, parallel=dict(tp=1, pp=2, dp=1), train=dict(recompute="selective", **c)),
        grid_config(1, "1f1b", 1, parallel=dict(tp=2, pp=1, dp=1), train=c),
        grid_config(1, "1f1b", 1, parallel=dict(tp=1, pp=1, dp=2, zero=3), train=dict(recompute="selective", **c)),
        grid_config(1, "1f1b", 1, parallel=dict(tp=1, pp=1, dp=1, cp=2), train=dict(recompute="selective", **c)),
    ]


def tight_ring_configs() -> list[Config]:
    return [grid_config(4, s, v, parallel=dict(tp=1, pp=4, dp=1, p2p="shared_memory")) for s, v in schedules_for(4)]


TIGHT = {"tight-rings"}  # run by _tight_rings_worker, after every other case of their launch


def _ids(layouts: list[tuple[int, int, int]]) -> list[str]:
    return [f"tp{a}-pp{b}-dp{c}" for a, b, c in layouts]


# Tests whose runs share one launch per world size. Each launch of 2 or 4 ranks costs 2-5 s before its
# first step (interpreters importing torch, and torch._dynamo at the first model build), more than the
# runs of most of these tests; every run still trains its own directory from scratch and each test checks
# exactly its own runs. Two launches at world 4 keep each well inside pytest's timeout on a loaded machine.
SHARED = {
    "world2": {
        **{f"layout-{k}": (layout_configs, lay) for k, lay in zip(_ids(LAYOUTS), LAYOUTS) if math.prod(lay) == 2},
        "unequal": (unequal_configs, ()),
        "compile": (compile_configs, ()),
    },
    "world4-llama": {
        **{f"layout-{k}": (layout_configs, lay) for k, lay in zip(_ids(LAYOUTS), LAYOUTS) if math.prod(lay) == 4},
        "tight-rings": (tight_ring_configs, ()),  # last: TIGHT
    },
    "world4-gpt2-tied": {
        **{f"gpt2-{k}": (gpt2_configs, lay) for k, lay in zip(_ids(GPT2_LAYOUTS), GPT2_LAYOUTS)},
        "tied": (tied_configs, ()),
    },
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    """check(key): the runs of SHARED's `key` against the single-device reference, out of its group's one
    launch (started by the first test that asks; a failed launch fails each test of its group). Returns the
    launch's directory and the index of `key`'s first run there (out/run{first + i})."""
    launched: dict[str, tuple[Path, list] | BaseException] = {}

    def check(key: str) -> None:
        group = next(g for g, cases in SHARED.items() if key in cases)
        cases = {k: make(*lay) for k, (make, lay) in SHARED[group].items()}
        if group not in launched:
            out = tmp_path_factory.mktemp(group)
            assert all(k in TIGHT for k in list(cases)[len(set(cases) - TIGHT) :]), "TIGHT cases go last"
            tight = sum(len(cases[k]) for k in TIGHT & set(cases))
            cfg_dicts = [c.to_dict() for cfgs in cases.values() for c in cfgs]
            world = next(iter(cases.values()))[0].parallel.world_size
            try:
                with computing([c for cfgs in cases.values() for c in cfgs]):  # the references, while the ranks run
                    results = run_ranks(_shared_worker, world, cfg_dicts, str(out), tight, timeout_s=400)[0]
                launched[group] = (out, results)
            except Exception as e:
                launched[group] = e
        if isinstance(launched[group], BaseException):
            raise launched[group]
        out, results = launched[group]
        keys = list(cases)
        first = sum(len(cases[k]) for k in keys[: keys.index(key)])  # its runs' place in the launch
        check_results(cases[key], results[first : first + len(cases[key])], out, first)
        return out, first

    return check


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=_ids(LAYOUTS))
def test_layout_matches_single_device(tp: int, pp: int, dp: int, tmp_path: Path, shared) -> None:
    if tp * pp * dp == 8:  # the only layout of its world size: its own launch
        check_layouts(layout_configs(tp, pp, dp), tmp_path)
    else:
        shared(f"layout-tp{tp}-pp{pp}-dp{dp}")


def test_pipelines_over_tight_shared_memory_rings(shared) -> None:
    shared("tight-rings")


def test_tied_embeddings_across_stages(shared) -> None:
    shared("tied")


def test_explicit_unequal_microbatches(shared) -> None:
    shared("unequal")


def test_compiled_layers_match_single_device(shared) -> None:
    out, first = shared("compile")
    # Recompiles bounded: every graph compiled in step 0 (rank 0's count in each step's record), none after.
    for i in range(len(compile_configs())):
        lines = (out / f"run{first + i}" / "metrics.jsonl").read_text().splitlines()
        graphs = [r["compiled_graphs"] for r in map(json.loads, lines) if "compiled_graphs" in r]
        assert len(graphs) == 3 and len(set(graphs)) == 1, f"run{first + i}: graphs per step {graphs}"


@pytest.mark.parametrize("tp,pp,dp", GPT2_LAYOUTS, ids=_ids(GPT2_LAYOUTS))
def test_gpt2_layout_matches_single_device(tp: int, pp: int, dp: int, shared) -> None:
    shared(f"gpt2-tp{tp}-pp{pp}-dp{dp}")


def test_odd_shapes(tmp_path: Path) -> None:
    cfgs = [
        odd_config(tp=3, pp=1, dp=1, schedule="1f1b"),
        odd_config(tp=3, pp=1, dp=1, schedule="1f1b", sequence_parallel=True),  # 33 tokens, 11 per rank
        odd_config(tp=1, pp=3, dp=1, schedule="zb-h1"),
        odd_config(tp=1, pp=1, dp=3, schedule="1f1b"),
    ]
    check_layouts(cfgs, tmp_path)
