"""Serving workers never outlive the server that started them.

A clean stop (Ctrl-C, SIGTERM) is handled by the server, which stops its workers. Nothing it runs
survives a SIGKILL or a crash, though, so on Linux each worker also asks the kernel for a
parent-death signal: SIGKILL as soon as its parent exits, however it exits (prctl(2),
PR_SET_PDEATHSIG). Elsewhere there is no such signal; a worker whose server died unannounced stops
when its next pipe read or point-to-point wait fails (at most `--timeout-s` later).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when its parent exits; exit at once if the parent
    (`parent_pid`, the process that started this one) is already gone. Returns False where the
    platform has no parent-death signal.

    Call it first thing in the child. Caveats (prctl(2)): the signal follows the parent *thread* that
    forked this process, so the parent must start its workers from a thread that lives as long as it
    does (the main thread); and it is cleared by exec of a set-user-ID binary (not done here)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    # The parent may have died between our fork and the prctl above: then no signal will ever come,
    # and we have already been re-parented (to init or a subreaper), so our parent id tells.
    if os.getppid() != parent_pid:
        os._exit(1)
    return True
