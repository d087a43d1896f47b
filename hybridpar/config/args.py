"""Argument parsing for the commands besides `train` (whose `--section.key` flags parse.py reads): argparse,
with one behaviour for all of them — an error is a ValueError of one line, naming the option and, for a
mistyped one, the option meant (as train's keys do), so that each command prints it its way and exits 2
before starting anything."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, NoReturn


class ArgParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors raise ValueError (see the module); no abbreviated options (a
    prefix that happens to match today would change meaning when an option is added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse says "argument --tp/--tp_x: invalid ..."; name the option as the user wrote it.
        message = re.sub(r"^argument ([^/: ]+)(/\S+)?: ", r"\1 ", message)
        if m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(choices)}"
            raise ValueError(f"{self.prog}: unknown command {m.group(1)!r}; {hint}")
        raise ValueError(message)

    def options(self) -> dict[str, argparse.Action]:
        """Every long option of this parser and its subcommands', with its action."""
        out = {s: a for s, a in self._option_string_actions.items() if s.startswith("--")}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for p in action.choices.values():
                    out.update(p.options())
        return out

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """parse_args, with every error a ValueError; a mistyped option is named first (argparse would
        report the required option it stands for as missing), and a value that starts with '-' (-inf,
        -1e3) is taken as the value it is."""
        known, args = self.options(), []
        for a in argv:
            name = a.split("=")[0]
            if args and args[-1] in known and known[args[-1]].nargs is None and a.startswith("-") and name not in known:
                args[-1] = f"{args[-1]}={a}"  # the previous option's value
                continue
            if name.startswith("--") and name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
                hint = f"did you mean {close[0]}?" if close else f"options: {', '.join(sorted(known))}"
                raise ValueError(f"unknown option {name}; {hint}")
            args.append(a)
        argv = args
        try:
            return self.parse_args(argv)
        except argparse.ArgumentError as e:
            self.error(str(e))


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expects a positive integer, got {text!r}")
    return int(text)


def nonnegative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expects a non-negative integer, got {text!r}")
    return int(text)


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects an integer, got {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number, got {text!r}") from None
