"""The commands besides `train` parse through one argparse subclass (config/args.py): errors are one line,
name the option as typed and the one meant, and values that start with '-' are values."""

from __future__ import annotations

import pytest

from hybridpar.cli import parse_export_args
from hybridpar.config.args import ArgParser, number
from hybridpar.data.prepare import parse_data_args


@pytest.mark.parametrize(
    "parse, argv, message",
    [
        (parse_export_args, ["r", "--out", "o", "--stpe", "3"], "unknown option --stpe; did you mean --step?"),
        (parse_export_args, ["r", "--out", "o", "--step", "x"], "--step expects a non-negative integer, got 'x'"),
        (parse_export_args, ["r"], "the following arguments are required: --out"),
        (parse_data_args, ["prepar"], "hybridpar data: unknown command 'prepar'; did you mean 'prepare'?"),
        (parse_data_args, ["prepare", "--tokenizr", "t", "--out", "o"], "did you mean --tokenizer?"),
        (parse_data_args, ["train-tokenizer", "--vocab-size", "0", "--out", "t"], "expects a positive integer"),
    ],
)
def test_errors_name_the_option_and_the_one_meant(parse, argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_value_may_start_with_a_dash() -> None:
    ap = ArgParser(prog="t", add_help=False)
    ap.add_argument("--low", type=number)
    ap.add_argument("--flag", action="store_true")
    assert ap.parse(["--low", "-inf", "--flag"]).low == float("-inf")
    assert ap.parse(["--low", "-1e3"]).low == -1000.0
    with pytest.raises(ValueError, match="--low expected one argument"):
        ap.parse(["--low", "--flag"])  # an option of ours is not a value
