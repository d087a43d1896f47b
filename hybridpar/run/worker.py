"""The module `hybridpar train` has torchrun start for each worker (`python -m hybridpar.run.worker`): it
ties the worker to its launcher first, then runs the trainer (`hybridpar.run.train`).

Importing torch and the trainer takes seconds, tens of them on loaded cores; a launcher killed outright in
that time left its workers running until they reached the trainer's own check (a chaos soak at load 48
counted two workers alive 30 s after their launcher's SIGKILL). What runs before the tie imports neither.
Plain torchrun (`torchrun ... -m hybridpar.run.train`) has no launcher of ours to tie to and needs none.
"""

from __future__ import annotations

import os
import sys

from hybridpar.resilience.rundir import LAUNCHER_ENV
from hybridpar.topology.lifetime import die_with_launcher


def main() -> int:
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and not die_with_launcher(int(launcher)):
        raise SystemExit("hybridpar: worker exits: its launcher is gone")
    from hybridpar.run.train import main as train

    return train()


if __name__ == "__main__":
    sys.exit(main())
