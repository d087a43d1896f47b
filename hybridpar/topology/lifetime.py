"""Workers never outlive their launcher.

torch's elastic agent starts each worker in a session of its own, so a signal to the launcher's process
group never reaches them, and a launcher killed outright (SIGKILL, OOM killer) leaves them training into
a directory that a new launch may already own. On Linux each worker asks the kernel for SIGKILL when its
parent dies (prctl PR_SET_PDEATHSIG), then checks that the parent is still the launcher it expects: had
the launcher died before the request, the worker would already be reparented and never get the signal.
Elsewhere (macOS, Windows) there is no such request: a worker finds out at its next checkpoint commit,
which checks the run directory's lock (resilience/rundir.py) and refuses to commit for a dead launcher.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(expected_parent: int | None) -> bool:
    """Linux: SIGKILL this process when its parent dies. Returns False if the parent is already not
    `expected_parent` (the caller should exit), True otherwise; a no-op returning True elsewhere.
    Call it first thing in the child. The signal follows the parent *thread* that started this process
    (prctl(2)), so launchers start their workers from a thread that lives as long as they do (the main
    thread, as torch's elastic agent and the serving pool do)."""
    if not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    return expected_parent is None or os.getppid() == expected_parent


def die_with(pid: int) -> bool:
    """Linux: SIGKILL this process as soon as process `pid` (an ancestor other than the parent) exits,
    watched through a pidfd by a daemon thread. Returns False if `pid` is already gone (the caller should
    exit), True otherwise; a no-op returning True where pidfds do not exist."""
    if not hasattr(os, "pidfd_open"):
        return True
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False

    def watch() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="hybridpar-die-with").start()
    return True


def die_with_launcher(launcher: int | None) -> bool:
    """A worker's tie to the process that launched it: its parent (torchrun's agent, a spawned or forked
    worker) through `die_with_parent`, or an ancestor (a worker the fork server forked) through `die_with`.
    False if the launcher is already gone (a worker whose launcher died before this check was re-parented,
    so its parent is no longer the launcher and its pid names no process)."""
    if launcher is None or os.getppid() == launcher:
        return die_with_parent(launcher)
    return die_with(launcher)


def release_groups() -> None:
    """Destroy every process group and join their backends' threads while the interpreter is whole.

    `destroy_process_group` forgets the groups, but the DeviceMesh's sub-groups live on while anything
    (the Topology, a cycle through the trainer) still refers to them, and their gloo worker threads with
    them. Such a thread may still hold the last reference to the work of the last collective, whose
    tensors it must release under the GIL; if the interpreter is finalising by then, Python ends the
    thread inside a C++ destructor and the process aborts ("terminate called without an active
    exception") after a run that succeeded -- and the elastic agent restarts a finished run. Collecting
    here drops the last references, and each group's destructor joins its threads (it lets go of the GIL
    while it waits)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
