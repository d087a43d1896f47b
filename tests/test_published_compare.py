"""hybridpar/bench/published_compare.py on two small published runs: pure (no processes), the planner for
real, with a quick stand-in for the memory model (weights, gradients and AdamW state of a rank's share: the
full model replays each schedule and is the slow part of a search)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hybridpar.bench import published_compare as pc
from hybridpar.config import Config
from hybridpar.model.registry import param_counts
from hybridpar.plan.published import load_runs

RUNS = load_runs()


@dataclass
class Held:
    total: int


def weights_only(cfg: Config, parts: list[range] | None = None) -> list[Held]:
    c, p = param_counts(cfg.model), cfg.parallel
    n = c.embed + cfg.model.n_layers * c.layer + c.head
    return [Held(int(n * (8 + (8 / p.dp if p.zero else 8)) / (p.tp * p.pp)))] * p.pp


@pytest.mark.parametrize("row_id", ["korthikanti-gpt-22b-a100", "korthikanti-gpt-175b-a100"])
def test_a_row_is_compared_in_its_published_unit(row_id: str) -> None:
    row = next(r for r in RUNS if r["id"] == row_id)
    out = pc.compare(row, memory=weights_only)
    basis = {v: k for k, v in pc.UNITS.items()}[out["unit"]]
    assert out["published"] == pc.published_figure(row, basis)
    # The unit conversion round-trips: the published figure in its own unit from its tokens/s.
    again = pc.in_published_unit(row, out["published_tokens_per_s_per_gpu"], basis)
    assert again == pytest.approx(out["published"], rel=1e-6)
    assert out["predicted_for_published_layout"] > 0 and out["choice_predicted"] > 0
    if out["published_layout_fits"]:  # the planner searched that layout too: its choice is no slower
        assert out["choice_tokens_per_s_per_gpu"] >= out["predicted_tokens_per_s_per_gpu"] * (1 - 1e-9)
    line = pc.markdown([out]).splitlines()[-1]
    assert line.startswith(f"| {row_id} |") and out["choice"] in line


def test_without_the_search_the_published_layout_alone_is_scored() -> None:
    row = next(r for r in RUNS if r["id"] == "korthikanti-gpt-22b-a100")
    quick = pc.compare(row, memory=weights_only, search=False)
    full = pc.compare(row, memory=weights_only)
    assert quick["choice"] is None and quick["plan_s"] is None
    assert quick["predicted_for_published_layout"] == full["predicted_for_published_layout"]
    assert pc.markdown([quick]).splitlines()[-1].endswith("(search not run) | |")


def test_a_layout_as_run_is_counted_with_its_own_chunks_and_gpu_messages() -> None:
    """Llama 3's chunks as run (embedding and head alone, pc.end_chunks) go to the memory model as explicit
    stages: the same estimate as the config's own partition where the two agree, and a rank whose first chunk
    holds the embedding alone saves less per microbatch than with a layer there too. The rows' messages go
    through the process group (they ran on GPUs), and a stage count that is not the layout's is refused."""
    from hybridpar.model.reference import tiny_config
    from hybridpar.plan.memory_model import rank_memory
    from hybridpar.plan.messages import transport
    from hybridpar.plan.published import row_config
    from hybridpar.trainer.build import layer_partition

    cfg = tiny_config(parallel=dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2), train=dict(microbatches=4))
    assert rank_memory(cfg, layer_partition(cfg)) == rank_memory(cfg)
    cfg.model.n_layers = 4
    ends = pc.end_chunks(cfg)
    assert [len(r) for r in ends] == [0, 2, 2, 0]
    apart, own = rank_memory(cfg, ends), rank_memory(cfg)
    assert sum(e.params for e in apart) == sum(e.params for e in own)  # the same model, cut otherwise
    assert apart[0].activations < own[0].activations  # rank 0's first chunk runs the embedding alone
    with pytest.raises(ValueError, match="3 stages given for a layout of 4"):
        rank_memory(cfg, ends[:3])
    assert all(transport(row_config(r)) == "process_group" for r in RUNS)
