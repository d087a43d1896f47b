"""How far inside the 1e-5 exactness bound each layout stays: the equivalence grid of
tests/test_equivalence.py, reporting the largest parameter and loss difference from single-device
fp32 training after 3 AdamW steps (JSON).

    .venv/bin/python bench/exactness.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_equivalence import LAYOUTS, _worker, reference, schedules_for, tiny_config  # noqa: E402

from hybridpar.testing import run_ranks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    records = []
    ref = None
    for tp, pp, dp in LAYOUTS:
        cfgs = [
            tiny_config(parallel=dict(tp=tp, pp=pp, dp=dp, schedule=s, virtual_stages=v)) for s, v in schedules_for(pp)
        ]
        with tempfile.TemporaryDirectory() as d:
            res = run_ranks(_worker, tp * pp * dp, [c.to_dict() for c in cfgs], d, timeout_s=600)
            ref = ref or reference(cfgs[0])
            ref_losses, _, ref_state = ref
            for i, c in enumerate(cfgs):
                state = torch.load(Path(d) / f"state{i}.pt", weights_only=True)
                records.append(
                    {
                        "tp": tp,
                        "pp": pp,
                        "dp": dp,
                        "schedule": c.parallel.schedule,
                        "virtual_stages": c.parallel.virtual_stages,
                        "max_param_diff": max((state[n] - r).abs().max().item() for n, r in ref_state.items()),
                        "max_loss_diff": max(abs(x - y) for x, y in zip(res[0][i][0], ref_losses)),
                    }
                )
    out = json.dumps(records, indent=1)
    print(out)
    print(
        json.dumps(
            {
                "worst_param_diff": max(r["max_param_diff"] for r in records),
                "worst_loss_diff": max(r["max_loss_diff"] for r in records),
                "bound": 1e-5,
            }
        )
    )
    if a.json:
        Path(a.json).write_text(out + "\n")


if __name__ == "__main__":
    main()
