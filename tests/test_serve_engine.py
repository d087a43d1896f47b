"""The serving engine generates exactly what one device generates: greedy tokens equal to
`generate` (full recompute, no cache) under tp=2, pp=2 and tp=2 x pp=2, with requests of mixed prompt
and output lengths joining and leaving micro-batches between steps (continuous batching over the paged
KV cache) and several micro-batches in flight through the pipeline, for every model family; the same
when a budget of a few KV blocks forces preemptions by recomputation; seeded sampling gives the same
tokens on every layout."""

from __future__ import annotations

import dataclasses

import pytest

from hybridpar.config import ModelConfig
from hybridpar.model.registry import build_full_model
from hybridpar.model.stage import generate
from hybridpar.serve.driver import Driver, Limits
from hybridpar.serve.engine import StageRunner
from hybridpar.serve.worker import WorkerSpec, serve_rank
from hybridpar.topology.spawn import run_ranks
from tests.replica import ListChannel, local_topology

CFG = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)
GPT2 = ModelConfig(family="gpt2", dim=32, n_layers=4, n_heads=4, ffn_dim=64, n_positions=64)
SEED = 3
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 200, 30, 40, 50, 60, 70], [42], [9, 9, 9, 9], [17, 18]]
N_TOKENS = [10, 6, 8, 12, 3, 9]
LIMITS = {"max_batch": 2, "max_groups": 3, "kv_tokens": 4096, "max_seq_len": 64}  # 3 micro-batches of 2
# Six blocks of 4 tokens for requests of up to 15 tokens (4 blocks): running ones run out, the youngest is
# preempted and recomputed.
# Steps of at most 3 tokens: every prompt longer than what the decodes leave is prefilled in chunks.
TINY = {**LIMITS, "kv_tokens": 24, "block_size": 4, "max_step_tokens": 3}


def requests(temperature: float = 0.0, top_p: float = 1.0) -> list[dict]:
    return [
        {
            "type": "generate",
            "id": f"r{i}",
            "prompt": p,
            "max_tokens": n,
            "temperature": temperature,
            "top_p": top_p,
            "seed": 100 + i,
        }
        for i, (p, n) in enumerate(zip(PROMPTS, N_TOKENS))
    ]


def _rank(spec_d: dict, reqs: list[dict]) -> dict | None:
    ch = ListChannel(reqs)
    status = serve_rank(spec_d, ch)
    return None if status is None else {"results": ch.results(), "status": status}


def spec(tp: int, pp: int, cfg: ModelConfig = CFG, limits: dict = LIMITS) -> dict:
    return dataclasses.asdict(
        WorkerSpec(model=dataclasses.asdict(cfg), source=f"init:{SEED}", tp=tp, pp=pp, limits=limits, timeout_s=60)
    )


def local_engine(reqs: list[dict], limits: dict = LIMITS) -> tuple[dict[str, list[int]], dict]:
    """The same engine on one device, in this process (no torch.distributed) -> (tokens, final status)."""
    topo = local_topology()
    ch = ListChannel(reqs)
    lim = Limits(**limits)
    runner = StageRunner(build_full_model(CFG, SEED).eval(), topo, kv_blocks=lim.kv_blocks, block_size=lim.block_size)
    status = Driver(runner, ch, lim).run()
    return ch.results(), status


def greedy_reference(reqs: list[dict] | None = None) -> dict[str, list[int]]:
    model = build_full_model(CFG, SEED)
    return {r["id"]: generate(model, r["prompt"], r["max_tokens"], temperature=0) for r in reqs or requests()}


# Prompts sharing a 13-token prefix (3 whole blocks of 4, then more): later ones take its blocks.
SHARED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
PREFIXED = [
    {"type": "generate", "id": f"p{i}", "prompt": SHARED + tail, "max_tokens": n, "temperature": 0.0}
    for i, (tail, n) in enumerate([([7], 5), ([7, 9, 3], 4), ([], 6), ([2] * 6, 3)])
]


def test_local_engine_greedy_matches_generate() -> None:
    got, status = local_engine(requests())
    assert got == greedy_reference() and status["preemptions"] == 0 and status["kv_used_tokens"] == 0


def test_local_engine_shares_prompt_prefixes_and_generates_the_same() -> None:
    got, status = local_engine(PREFIXED, {**LIMITS, "block_size": 4, "max_batch": 1, "max_groups": 1})
    assert got == greedy_reference(PREFIXED)
    assert status["prefix_hit_tokens"] == 3 * 12  # p1, p2, p3 each took the 3 whole blocks p0 computed


def test_local_engine_chunked_prefill_generates_the_same() -> None:
    got, status = local_engine(requests() + PREFIXED, {**LIMITS, "max_step_tokens": 3})
    assert got == greedy_reference(requests() + PREFIXED)


def test_local_engine_greedy_survives_preemption_by_recomputation() -> None:
    got, status = local_engine(requests(), TINY)
    assert status["preemptions"] > 0 and status["kv_capacity_tokens"] == 24
    assert got == greedy_reference() and status["kv_used_tokens"] == 0  # every block came back


def _sampled(reqs: list[dict]) -> list[dict]:
    return [{**r, "id": "s" + r["id"], "temperature": 0.9, "top_p": 0.8} for r in reqs]


# (tp, pp, model) -> the requests it serves; tp2 x pp2 Llama also samples.
SHARDED = {
    (2, 1, "llama"): requests(),
    (1, 2, "llama"): requests(),
    (2, 2, "llama"): requests() + _sampled(requests()),
    (2, 2, "gpt2"): requests(),
    (2, 2, "preempt"): requests() + PREFIXED,  # Llama under TINY limits
}
MODELS = {"llama": CFG, "gpt2": GPT2, "preempt": CFG}


def _ranks(cases: list[tuple[dict, list[dict]]]) -> list[dict | None]:
    """_rank for each case in turn: each builds its own topology and stages from scratch."""
    return [_rank(*case) for case in cases]


@pytest.fixture(scope="module")
def served():
    """serve(case): rank 0's result of SHARDED's `case`. The cases of one world size are served in turn in
    one launch (started by the first test that asks): a launch costs 2-5 s of interpreters importing
    torch before their first request, more than serving these. A failed launch fails each of its tests."""
    launched: dict[int, dict | BaseException] = {}

    def serve(case: tuple[int, int, str]) -> dict:
        world = case[0] * case[1]
        if world not in launched:
            group = [c for c in SHARDED if c[0] * c[1] == world]
            args = [
                (spec(tp, pp, MODELS[m], TINY if m == "preempt" else LIMITS), SHARDED[(tp, pp, m)])
                for tp, pp, m in group
            ]
            try:
                launched[world] = dict(zip(group, run_ranks(_ranks, world, args, timeout_s=120 * len(group))[0]))
            except Exception as e:
                launched[world] = e
        if isinstance(launched[world], BaseException):
            raise launched[world]
        return launched[world][case]

    return serve


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_sharded_greedy_matches_generate(tp: int, pp: int, served) -> None:
    want = greedy_reference()
    driver = served((tp, pp, "llama"))
    got = driver["results"]
    assert {k: v for k, v in got.items() if k.startswith("r")} == want
    if pp > 1:  # several groups were in the pipeline at once, one per stage
        assert driver["status"]["max_in_flight"] == pp
    if (tp, pp) == (2, 2):  # seeded temperature/top-p sampling: same tokens as on one device
        sampled = local_engine(_sampled(requests()))[0]
        assert {k: v for k, v in got.items() if k.startswith("s")} == sampled
        assert any(sampled[f"sr{i}"] != want[f"r{i}"] for i in range(len(PROMPTS)))  # it did sample


@pytest.mark.multiprocess
def test_gpt2_sharded_greedy_matches_generate(served) -> None:
    """GPT-2's cached forward (learned positions read at each row's own offsets, biases, fused q/k/v
    split per head over tp) serves what its full forward generates."""
    model = build_full_model(GPT2, SEED)
    want = {f"r{i}": generate(model, p, n, temperature=0) for i, (p, n) in enumerate(zip(PROMPTS, N_TOKENS))}
    out = served((2, 2, "gpt2"))
    assert out["results"] == want and out["status"]["max_in_flight"] == 2


@pytest.mark.multiprocess
def test_sharded_greedy_survives_preemption_by_recomputation(served) -> None:
    """tp2 x pp2 with six KV blocks and steps of 3 tokens: sequences are preempted (only those not in the
    pipeline), their blocks reused by others, and recomputed later, prompts are prefilled in chunks and
    those with a common prefix share its blocks; every request still gets single-device greedy tokens."""
    out = served((2, 2, "preempt"))
    assert out["results"] == greedy_reference(requests() + PREFIXED)
    assert out["status"]["preemptions"] > 0 and out["status"]["kv_used_tokens"] == 0


class _CancellingChannel(ListChannel):
    """Cancels r1 on the driver's second receive (its group launched, no token yet), r5 while it
    waits, and r0 once it has streamed 2 tokens."""

    def __init__(self, reqs: list[dict]) -> None:
        super().__init__(reqs)
        self.calls, self.sent_r0 = 0, False
        self._todo.pop()  # the stop comes last, after the cancels

    def recv(self, timeout_s: float) -> list[dict]:
        self.calls += 1
        out, self._todo = self._todo, []
        if self.calls == 2:
            out += [{"type": "cancel", "id": "r1"}, {"type": "cancel", "id": "r5"}, {"type": "cancel", "id": "nope"}]
        r0 = [e for e in self.events if e["type"] == "token" and e["id"] == "r0"]
        if len(r0) >= 2 and not self.sent_r0:
            self.sent_r0 = True
            out += [{"type": "cancel", "id": "r0"}, {"type": "stop"}]
        return out


def test_cancel_stops_waiting_and_running_requests_and_spares_the_rest() -> None:
    model, want = build_full_model(CFG, SEED), greedy_reference()
    ch = _CancellingChannel(requests())
    Driver(StageRunner(model.eval(), local_topology()), ch, Limits(**{**LIMITS, "max_groups": 1})).run()
    done = {e["id"]: e for e in ch.events if e["type"] == "done"}
    assert {k: done[k]["reason"] for k in ("r0", "r1", "r5")} == {
        "r0": "cancelled",
        "r1": "cancelled",
        "r5": "cancelled",
    }
    assert done["r1"]["tokens"] == [] and done["r5"]["tokens"] == []  # before its first token / while waiting
    r0 = done["r0"]["tokens"]
    assert 2 <= len(r0) < N_TOKENS[0] and r0 == want["r0"][: len(r0)]
    for k in ("r2", "r3", "r4"):  # the others, r2 and r3 in a group formed after the cancels, are untouched
        assert done[k]["reason"] == "length" and done[k]["tokens"] == want[k], k


def test_a_stop_token_ends_a_request_even_as_its_last_allowed_token() -> None:
    """Each request stops at its greedy output's last token: where that is the first time it comes (the
    boundary, max_tokens reached by the stop token itself) the reason is still "stop", as OpenAI reports."""
    ref = greedy_reference()
    reqs = [{**r, "stop_tokens": [ref[r["id"]][-1]]} for r in requests()]
    ch = ListChannel(reqs)
    Driver(StageRunner(build_full_model(CFG, SEED).eval(), local_topology()), ch, Limits(**LIMITS)).run()
    done = {e["id"]: e for e in ch.events if e["type"] == "done"}
    boundary = 0
    for rid, want in ref.items():
        end = want.index(want[-1]) + 1  # up to the stop token's first appearance
        boundary += end == len(want)
        assert (done[rid]["tokens"], done[rid]["reason"]) == (want[:end], "stop")
    assert boundary > 0  # the boundary case is among them
