"""Test lanes. A test that starts processes (worker ranks, launchers, servers, subprocesses) carries
`@pytest.mark.multiprocess` (or its module's `pytestmark`); `pytest -m "not multiprocess"` runs the
rest, the fast pure lane. The mark is enforced: an unmarked test that starts a process fails at once,
naming the mark, so the fast lane stays fast and honest."""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _processes_need_the_mark(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("multiprocess") is not None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.multiprocess")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


def pytest_sessionstart(session: pytest.Session) -> None:
    """matplotlib lists the system's fonts with `fc-list` the first time it is imported on a machine (it
    then caches them): do it here, before the guard above, so that a pure test drawing a plot on a fresh
    machine is not taken for one that starts processes.

    One intra-op thread in the test process, as in every rank (topology/spawn.py): its in-process work is
    the tests' one-device reference runs and yardsticks, a tiny model whose ops are too small to share. On
    2 cores where the other one is busy, torch's second thread makes them wait for each other: a yardstick
    (13 runs of tiny_config) took 77-112 s with two threads and 8-14 s with one at a load average of 9.
    Their results are as valid either way (another summation order, of the kind the yardstick measures),
    and the yardstick's factor was derived single-threaded (bench/exactness.py)."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that start processes first, the pure files after them (each file's order kept). The two
    workers take whole files in this order (`--no-loadscope-reorder`, pyproject.toml): the pure files, short
    and many, then fill whichever worker ends its launches first. With xdist's own order (most tests
    first) a world-4 file came last and ran 75 s alone while the other worker idled."""
    launches = {item.path for item in items if item.get_closest_marker("multiprocess") is not None}
    items.sort(key=lambda item: item.path not in launches)
