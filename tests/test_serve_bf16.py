"""`hybridpar serve --dtype bf16` on a trained tiny model: the fp32 weights cast after loading, KV cache and
stage-to-stage activations in bf16, logits widened to fp32 before sampling.

The tolerances, derived. bf16 keeps 8 significant bits: each rounding moves a value by at most its unit
roundoff u = 2^-9, relative. To first order such relative errors add along the computation, and the
residual stream and the norms keep them from growing from layer to layer, so a logit moves by at most
(number of roundings on its path) x u x the logits' scale (their largest magnitude).
- pp: a stage boundary sends the bf16 hidden state the single process holds anyway: no rounding is added,
  so pp=2 serves bit for bit what one process serves in bf16.
- tp: each row-parallel matmul (attention output and MLP down projection, 2 per layer) rounds every
  rank's partial sum to bf16 and the all-reduce rounds their sum: 2 roundings more per reduction, 4 per
  layer; each column-parallel one (q, k, v, gate, up: 5 per layer, and the head) multiplies a narrower
  matrix, whose kernel may sum in another order and so round its output one unit off: 1 more each. Over
  L layers (9 L + 1) u.
- bf16 against fp32: per layer the input of each of the 7 weight matmuls and its output (14), each of the
  7 weights (7), the two norms, rotary embedding, attention scores, softmax, the SwiGLU product and the
  two residual additions (8): about 29 roundings, and 5 more in the embedding, final norm and head; so
  (29 L + 5) u.
Greedy tokens may then legitimately differ only where the reference's two best logits are within twice
that bound of each other: the test checks logits first, and tokens up to such a near tie.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hybridpar.model.reference import U_BF16, reference, tiny_config
from hybridpar.serve.config import ServeConfig, parse_serve_args
from hybridpar.serve.driver import Driver, Limits
from hybridpar.serve.engine import OP_STEP, StageRunner, Tick
from hybridpar.serve.worker import WorkerSpec, build_serving_stage
from hybridpar.topology.spawn import run_ranks
from hybridpar.trainer.export import write_model_dir
from tests.replica import ListChannel, local_topology

CFG = tiny_config(model=dict(n_layers=4), train=dict(steps=40, val_every=0))
L = CFG.model.n_layers
TP_BOUND = (9 * L + 1) * U_BF16  # x the logits' scale
FP32_BOUND = (29 * L + 5) * U_BF16
PROMPTS = [list(b"def main("), list(b"import "), list(b"class Foo:\n    "), list(b"return ")]
N_TOKENS = 12
LIMITS = {"max_batch": 1, "max_groups": 1, "kv_tokens": 4096, "max_seq_len": 64}  # one row at a time: one order


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A trained tiny model (40 AdamW steps on the embedded corpus) as a Hugging Face directory (fp32)."""
    state = reference(CFG)[2]
    out = tmp_path_factory.mktemp("trained") / "final"
    return str(write_model_dir(state, CFG.model, out, {"step": CFG.train.steps}))


class RecordingRunner(StageRunner):
    """A StageRunner that keeps the logits the driver samples from (pp=1: its own; pp>1: received)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.seen: list[list[float]] = []

    def run(self, tick: Tick) -> torch.Tensor | None:
        out = super().run(tick)
        if out is not None and self.pp == 1:
            self.seen += out.tolist()
        return out

    def wait_logits(self, seq: int) -> torch.Tensor:
        out = super().wait_logits(seq)
        self.seen += out.tolist()
        return out


def requests() -> list[dict]:
    return [
        {"type": "generate", "id": f"r{i}", "prompt": p, "max_tokens": N_TOKENS, "temperature": 0.0}
        for i, p in enumerate(PROMPTS)
    ]


def spec(source: str, dtype: str, tp: int = 1, pp: int = 1) -> WorkerSpec:
    return WorkerSpec(model=dataclasses.asdict(CFG.model), source=source, tp=tp, pp=pp, limits=LIMITS, dtype=dtype)


def serve_local(source: str, dtype: str) -> tuple[dict, list]:
    """(tokens per request, logits in tick order) of one in-process replica."""
    topo = local_topology()
    runner = RecordingRunner(build_serving_stage(spec(source, dtype), topo), topo)
    ch = ListChannel(requests())
    Driver(runner, ch, Limits(**LIMITS)).run()
    return ch.results(), runner.seen


def _rank(spec_d: dict) -> dict | None:
    from hybridpar.topology.mesh import build_topology

    s = WorkerSpec(**spec_d)
    topo = build_topology(s.dp, s.pp, s.tp, "gloo", s.timeout_s)
    runner = RecordingRunner(build_serving_stage(s, topo), topo)
    if not runner.is_driver:
        runner.serve_forever()
        return None
    ch = ListChannel(requests())
    Driver(runner, ch, Limits(**s.limits)).run()
    return {"results": ch.results(), "logits": runner.seen}


def compare(got: tuple[dict, list], want: tuple[dict, list], rel: float) -> float:
    """Logits of every tick within rel x the logits' scale of the reference's, as long as both served the
    same tokens; a token may differ only at a near tie of the reference. Returns the largest difference
    over the scale."""
    (tok_g, log_g), (tok_w, log_w) = got, want
    worst, k = 0.0, 0
    for rid, want_tokens in tok_w.items():
        for j, w_tok in enumerate(want_tokens):
            a, b = torch.tensor(log_g[k + j]), torch.tensor(log_w[k + j])
            diff = (a - b).abs().max().item() / b.abs().max().item()
            worst = max(worst, diff)
            assert diff <= rel, f"{rid} token {j}: logits differ by {diff:.3g} x their scale, bound {rel:.3g}"
            if tok_g[rid][j] != w_tok:
                top2 = b.topk(2).values
                gap = (top2[0] - top2[1]).item() / b.abs().max().item()
                assert gap <= 2 * rel, f"{rid} token {j}: {tok_g[rid][j]} != {w_tok} with a top-2 gap of {gap:.3g}"
                break
        k += len(want_tokens)
    return worst


def test_bf16_logits_near_fp32_and_tokens_equal_up_to_near_ties(model_dir: str) -> None:
    fp32, bf16 = serve_local(model_dir, "fp32"), serve_local(model_dir, "bf16")
    worst = compare(bf16, fp32, FP32_BOUND)
    assert worst > 0  # bf16 did round: the weights really were cast
    print(f"bf16 vs fp32: largest logit difference {worst:.3g} x scale (bound {FP32_BOUND:.3g})")


def test_bf16_kv_cache_bytes_halve(model_dir: str) -> None:
    sizes = {}
    for dtype in ("fp32", "bf16"):
        topo = local_topology()
        runner = StageRunner(build_serving_stage(spec(model_dir, dtype), topo), topo)
        x = torch.tensor([PROMPTS[0]])
        meta = torch.tensor([[0], [len(PROMPTS[0])], [0]])  # start, new tokens, its one block
        logits = runner.run(Tick(OP_STEP, seq=1, meta=meta, x=x))
        assert logits.dtype == torch.float32  # sampling reads fp32 logits in either case
        sizes[dtype] = runner.kv_bytes()
        assert all(p.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype] for p in runner.stage.parameters())
    assert sizes["fp32"] > 0 and sizes["bf16"] * 2 == sizes["fp32"], sizes


SHARDED = [(1, 2), (2, 1)]


def _ranks(spec_ds: list[dict]) -> list[dict | None]:
    """_rank for each spec in turn: each builds its own topology and stages from scratch."""
    return [_rank(d) for d in spec_ds]


@pytest.fixture(scope="module")
def sharded(model_dir: str) -> dict[tuple[int, int], dict]:
    """Rank 0's result for each 2-rank layout of SHARDED, served in turn in one launch (a launch costs ~2 s
    of two interpreters importing torch, more than serving these requests)."""
    specs = [dataclasses.asdict(spec(model_dir, "bf16", tp, pp)) for tp, pp in SHARDED]
    return dict(zip(SHARDED, run_ranks(_ranks, 2, specs, timeout_s=180)[0]))


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,pp", SHARDED)
def test_sharded_bf16_serves_what_one_process_does(model_dir: str, tp: int, pp: int, sharded: dict) -> None:
    single = serve_local(model_dir, "bf16")
    out = sharded[tp, pp]
    if pp > 1:  # no rounding added at a stage boundary: bit for bit
        assert out["results"] == single[0] and out["logits"] == single[1]
    else:
        worst = compare((out["results"], out["logits"]), single, TP_BOUND)
        print(f"tp={tp} bf16 vs one process: largest logit difference {worst:.3g} x scale (bound {TP_BOUND:.3g})")


def test_dtype_is_checked_up_front() -> None:
    cfg, _ = parse_serve_args(["--dtype", "bf16"])
    assert cfg.dtype == "bf16" and ServeConfig().dtype == "fp32"
    with pytest.raises(ValueError, match=r"^serve dtype='fp16' is not one of fp32, bf16$"):
        parse_serve_args(["--dtype", "fp16"])[0].validate()
    with pytest.raises(ValueError, match=r"^serve dtype='half' is not one of fp32, bf16$"):
        WorkerSpec(model={}, source="init:0", dtype="half")


def test_model_dir_is_fp32(model_dir: str) -> None:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
