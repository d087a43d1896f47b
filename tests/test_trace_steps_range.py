"""--trace with profile.trace_steps starting past the run's last step is refused before launch (the run
went on and wrote an empty trace); a range the end cuts short still traces what it reaches. Pure."""

from __future__ import annotations

import pytest

from hybridpar.config import parse_args
from hybridpar.pipeline.schedules.config_rules import validate_config


def test_a_trace_of_steps_the_run_never_reaches_is_refused() -> None:
    cfg = parse_args(["--trace", "t.json", "--profile.trace_steps", "9-10", "--train.steps", "5"])
    with pytest.raises(ValueError, match=r"profile.trace_steps='9-10', which starts past the run's last step 4"):
        validate_config(cfg)


def test_a_trace_range_cut_short_by_the_end_or_no_trace_at_all_is_accepted() -> None:
    validate_config(parse_args(["--trace", "t.json", "--train.steps", "2"]))  # the default 1-3 reaches step 1
    validate_config(parse_args(["--profile.trace_steps", "9-10", "--train.steps", "5"]))  # no --trace: unused
