"""The report of a real run — a live rebalance moves layers off an emulated slow rank, then an injected
fault kills a worker and the elastic agent restarts the run from its checkpoint — loaded from file:// in
Debian's headless Chromium: no console error, every image decodes, the screenshot is not blank. The page's
stability figures match what the run did. First the checks themselves are shown to catch a bad page."""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path

import pytest

from tests.cdp import Chromium, errors_of, find_chromium
from tests.launches import run_forked
from tests.test_chaos import HANG_S, _records
from tests.test_equivalence import tiny_config

pytestmark = pytest.mark.multiprocess  # a launcher, its workers and a browser

pytest.importorskip("matplotlib", reason="hybridpar report needs matplotlib (the report extra)")
DECODE_ALL = (
    "Promise.all(Array.from(document.images).map(i => i.decode()"
    ".then(() => [i.naturalWidth, i.naturalHeight], e => String(e))))"
)


def _open(browser: Chromium, url: str) -> tuple[list, bytes]:
    """Load `url` in a fresh tab: (each image's decoded size or error, a PNG screenshot)."""
    tab = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    s = browser.send("Target.attachToTarget", {"targetId": tab, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log"):
        browser.send(f"{domain}.enable", session=s)
    browser.events.clear()
    browser.send("Page.navigate", {"url": url}, session=s)
    browser.wait_event("Page.loadEventFired")
    got = browser.send("Runtime.evaluate", {"expression": DECODE_ALL, "awaitPromise": True, "returnByValue": True}, s)
    shot = browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=s)
    return got["result"]["value"], base64.b64decode(shot["data"])


def _not_blank(png: bytes) -> float:
    """Share of the screenshot's pixels that are not the page background (white)."""
    from matplotlib.image import imread

    px = imread(io.BytesIO(png), format="png")[..., :3]
    return float((px.min(axis=-1) < 0.9).mean())


def _cell(page: str, figure: str) -> str:
    row = re.search(rf"<tr><th>{re.escape(figure)}</th><td[^>]*>(.*?)</td>", page)
    assert row, figure
    return html.unescape(row.group(1))


def test_report_of_a_real_run_in_headless_chromium(tmp_path: Path) -> None:
    exe = find_chromium()
    if exe is None:
        pytest.skip(
            "Debian's chromium is not installed and could not be (.ci/run installs it: apt-get install chromium)"
        )
    steps, fault_step = 14, 10
    cfg = tiny_config(
        parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b", partition="uniform", timeout_s=30.0),
        train=dict(steps=steps, val_every=5, monitor_every=3),
        # Rank 1 emulated 3x slow from the start: the balancer moves layers off it well before the fault.
        emulate=dict(layer_ms=2.0, slowdown="rank=1:3.0@step=0", fault=f"rank=1:kill@step={fault_step}:phase=forward"),
        balance=dict(mode="auto", interval=4, window=3, patience=2, threshold=1.6, persist=1),
        resilience=dict(hang_timeout_s=HANG_S, heartbeat_s=0.25, slow_phase_timeout_s=30.0, max_restarts=2),
        checkpoint=dict(every=4, keep=2),  # the kill in step 10 loses steps 8 and 9: trained again
    )
    run = tmp_path / "run"
    cfg.run_dir = str(run)
    run_forked(cfg)
    moves = [e for x in _records(run, "metrics.jsonl") for e in x.get("balance", []) if e["event"] == "rebalance"]
    assert moves and moves[0]["applied"] and moves[0]["step"] < fault_step, moves
    assert len(_records(run, "chaos.jsonl")) == 1

    from hybridpar.cli import main as cli_main

    assert cli_main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert _cell(page, "interruptions") == "1" and _cell(page, "recomputed steps") == "2"
    assert _cell(page, "lost / duplicated samples") == "0 / 0"
    assert float(_cell(page, "MTTR").removesuffix(" s")) > 0
    assert 0 < float(_cell(page, "goodput").removesuffix(" %")) < 100
    assert "rank 1, steps" in _cell(page, "straggler episodes")  # 3x slow per unit of work, all run
    # A bad page, to show that the checks catch one: a script error and an image that cannot decode.
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><img src="data:image/png;base64,AAAA"><script>console.error("boom")</script>')
    browser = Chromium(exe)
    try:
        images, _ = _open(browser, bad.as_uri())
        assert isinstance(images[0], str) and "boom" in " ".join(errors_of(browser.events))
        images, shot = _open(browser, (run / "report.html").as_uri())
        assert errors_of(browser.events) == []
    finally:
        browser.close()
    assert len(images) == 9 and all(isinstance(i, list) and i[0] > 200 and i[1] > 100 for i in images), images
    assert _not_blank(shot) > 0.02
