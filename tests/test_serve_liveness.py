"""`/health` watches every stage worker of every replica: a killed pipeline stage turns it 503 within
seconds, its replica leaves routing (its other workers are stopped) and the other replica serves on."""

from __future__ import annotations

import time

import pytest

from tests.serving import call, live_server

pytestmark = pytest.mark.multiprocess  # every test here starts a live server with four worker processes


@pytest.mark.timeout(240)
def test_a_killed_stage_worker_turns_health_503_and_the_other_replica_serves() -> None:
    # dp=2 replicas of pp=2: ranks 0, 1 are replica 0 (stage 0 = its driver, stage 1), ranks 2, 3 replica 1.
    good = {"model": "hybridpar", "prompt": "def ", "max_tokens": 4, "temperature": 0}
    with live_server(dp=2, pp=2, strategy="round_robin", client_timeout_s=30) as (port, svc):
        status, body = call(port, "GET", "/health")
        assert status == 200 and body["replicas_alive"] == 2
        want = [call(port, "POST", "/v1/completions", good)[1]["choices"][0]["text"] for _ in range(2)]
        assert want[0] == want[1]  # both replicas answer (round robin), greedily alike

        victim = svc.pool.procs[1]  # replica 0's second pipeline stage: not the process its pipe is to
        killed = time.monotonic()
        victim.kill()
        while True:
            status, body = call(port, "GET", "/health")
            took = time.monotonic() - killed
            if status == 503 or took > 15:
                break
            time.sleep(0.05)
        print(f"\n/health 503 {took:.3f} s after the stage worker was killed")
        assert status == 503 and took < 5.0, (status, body, took)
        assert body["status"] == "degraded" and body["replicas_alive"] == 1
        failed = [(w["replica"], w["rank"], w["stage"]) for w in body["failed_workers"]]
        assert failed[0] == (0, 1, 1) and {f[0] for f in failed} == {0}, failed  # (the driver may fail too)
        assert svc.router.live() == [1]
        deadline = time.monotonic() + 30  # the broken replica's other worker is stopped, not left waiting
        while svc.pool.procs[0].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert svc.pool.procs[0].exitcode is not None and svc.pool.procs[2].exitcode is None

        for _ in range(4):  # round robin now has one place to go
            status, out = call(port, "POST", "/v1/completions", good)
            assert status == 200 and out["choices"][0]["text"] == want[0]
        assert svc.counters["requests_failed"] == 0
