"""`hybridpar bench pipeline`: the emulated stage's autograd Function, the busy-time instrumentation, a
multi-process smoke run against torch.distributed.pipelining, and bad inputs. No speed assertions."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hybridpar.bench.emulated import BusyTimer, EmulatedStage, SleepScale, Timed
from hybridpar.bench.pipeline import main
from hybridpar.cli import main as cli_main

FIELDS = ("mode", "schedule", "pp", "microbatches", "f_ms", "b_ms", "hybridpar_steps_per_s", "torch_steps_per_s",
          "ratio", "bubble_measured", "torch_bubble_measured", "bubble_theory", "loss_match", "repeats")


def test_sleep_scale_sleeps_and_has_exact_gradients():
    x = torch.randn(2, 3, 4, requires_grad=True)
    scale = torch.tensor([1.5], requires_grad=True)
    t0 = time.perf_counter()
    y = SleepScale.apply(x, scale, 0.02, 0.04)
    t_f = time.perf_counter() - t0
    g = torch.randn_like(y)
    t0 = time.perf_counter()
    y.backward(g)
    t_b = time.perf_counter() - t0
    assert t_f >= 0.02 and t_b >= 0.04
    torch.testing.assert_close(y, x.detach() * 1.5)
    torch.testing.assert_close(x.grad, g * 1.5)
    torch.testing.assert_close(scale.grad, (g * x.detach()).sum().reshape(1))
    xd = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    sd = torch.tensor([0.7], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: SleepScale.apply(a, b, 0.0, 0.0), (xd, sd))


def test_emulated_stage_is_deterministic_and_timed_wrapper_is_exact():
    a, b = EmulatedStage(True, True, 16, 8, 0.005, 0.01, seed=3), EmulatedStage(True, True, 16, 8, 0.005, 0.01, seed=3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    tok = torch.randint(16, (2, 5))
    ref = a(tok)  # (2, 5, 16) logits
    ref.sum().backward()
    timer = BusyTimer()
    timed = Timed(b, timer)
    out = timed(tok)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.sum().backward()
    timer.close()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert 0.015 <= timer.busy < 1.0  # forward 5 ms + backward 10 ms, and not the time outside them
    mid = Timed(EmulatedStage(False, False, 16, 8, 0.0, 0.01, seed=4), BusyTimer())
    h = torch.randn(2, 5, 8, requires_grad=True)
    mid(h).sum().backward()
    time.sleep(0.05)  # idle after the backward is not busy time
    mid.timer.close()
    assert 0.01 <= mid.timer.busy < 0.05
    assert h.grad is not None


@pytest.mark.timeout(120)
def test_smoke_emulated_against_torch(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["--mode", "emulated", "--pp", "2", "--microbatches", "4", "--schedules", "1f1b",
               "--f-ms", "2", "--b-ms", "4", "--repeats", "2", "--steps", "2", "--json", str(out)])
    assert rc == 0
    (rec,) = json.loads(out.read_text())
    for f in FIELDS:
        assert f in rec, f
    assert rec["mode"] == "emulated" and rec["schedule"] == "1f1b" and rec["pp"] == 2 and rec["repeats"] == 2
    assert rec["loss_match"] is True and rec["torch_error"] is None
    assert rec["grad_rel_diff"] <= 1e-5
    assert rec["hybridpar_steps_per_s"] > 0 and rec["torch_steps_per_s"] > 0 and rec["ratio"] > 0
    for key in ("bubble_measured", "torch_bubble_measured", "bubble_theory"):
        assert 0 <= rec[key] < 1, (key, rec[key])


@pytest.mark.timeout(120)
def test_uneven_batch_measures_ours_without_torch(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["--pp", "2", "--microbatches", "4", "--global-batch", "6", "--schedules", "gpipe",
               "--f-ms", "1", "--b-ms", "2", "--repeats", "1", "--steps", "1", "--json", str(out)])
    assert rc == 0
    (rec,) = json.loads(out.read_text())
    assert rec["hybridpar_steps_per_s"] > 0 and 0 <= rec["bubble_measured"] < 1
    assert rec["torch_steps_per_s"] is None and rec["ratio"] is None and rec["loss_match"] is None
    assert "not divisible" in rec["torch_error"]


@pytest.mark.parametrize("args, msg", [
    (["--pp", "1"], "--pp values must be at least 2"),
    (["--schedules", "1f1x"], "did you mean '1f1b'"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--microbatches", "6", "--pp", "4", "--schedules", "interleaved-1f1b"], "divisible by pp"),
    (["--mode", "compute", "--layers", "2", "--pp", "4", "--schedules", "1f1b"], "fewer than the 4 stages"),
])
def test_bad_inputs_are_refused_before_any_process(args, msg, capsys):
    assert cli_main(["bench", "pipeline", *args]) == 2
    assert msg in capsys.readouterr().err


def test_cli_bench_dispatch(capsys):
    assert cli_main(["bench", "nope"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "pipeline", "--help"])
    assert e.value.code == 0 and "--act-kb" in capsys.readouterr().out
