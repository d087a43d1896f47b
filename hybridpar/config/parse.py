"""Reading a Config from TOML files and `--section.key VALUE` flags, and the --help that lists them."""

import dataclasses
import json
import typing
from typing import Any

import tomllib

from hybridpar.config.config import Config
from hybridpar.config.keys import RETIRED, _known_keys, _owner, _suggest, _type_name, _unwrap


def load_toml(path: str, what: str = "config file") -> dict[str, Any]:
    """Read a TOML file as a raw dict: a config ([model] [parallel] [train] [data] [checkpoint] sections,
    top-level run_dir), or any other (`what` names it in the error)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as e:  # missing file, a directory, no permission: all a bad argument
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{what} {path!r} is not valid TOML: {e}") from None


def parse_args(argv: list[str], given: set[str] | None = None) -> Config:
    """Build a Config from `--config FILE` (applied first) then `--section.key VALUE` overrides in order.
    Does not validate: the caller knows the world size. `given`, if passed, receives the dotted keys the
    file or the flags set (what the user chose, as against the defaults)."""
    known = _known_keys(Config)
    config_file: str | None = None
    overrides: list[tuple[str, str, str]] = []  # (flag as typed, dotted key, raw value)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"unexpected argument {arg!r}: options look like --section.key VALUE")
        name, has_eq, value = arg[2:].partition("=")
        if not has_eq:
            # A following flag is not a value: `--train.steps --train.lr 1` forgot the steps.
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"missing value for --{name}")
            value = argv[i + 1]
            i += 1
        i += 1
        key = name.replace("-", "_")  # --train.global-batch and --run-dir are spelled like the fields
        key = _ALIASES.get(key, key)
        if key == "config":
            if config_file is not None:
                raise ValueError(f"--config given twice ({config_file!r} and {value!r}); pass one file")
            config_file = value
        elif key in known:
            overrides.append((f"--{name}", key, value))
        elif key in RETIRED:
            raise ValueError(f"--{name}: {RETIRED[key]}")
        else:
            raise ValueError(f"unknown option --{name}{_suggest(key, ['config', *known], _flag)}")
    cfg = Config()
    if config_file is not None:
        raw = load_toml(config_file)
        try:
            cfg = Config.from_dict(raw)
        except ValueError as e:  # every bad key of the file, and the file's name
            raise ValueError(f"config file {config_file!r}: {e}") from None
        if given is not None:
            for k, v in raw.items():
                given.update([f"{k}.{x}" for x in v] if isinstance(v, dict) else [k])
    for flag, key, value in overrides:
        setattr(*_owner(cfg, key), _parse_text(flag, value, known[key].type))
    if given is not None:
        given.update(key for _, key, _ in overrides)
    return cfg


def override_flags(cfg: Config, keys: list[str]) -> list[str]:
    """`--key=VALUE` for each dotted key, written so that parse_args reads `cfg`'s value back."""

    def text(v: Any) -> str:
        if v is None or isinstance(v, bool):
            return str(v).lower()
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)

    return [f"{_flag(k)}={text(getattr(*_owner(cfg, k)))}" for k in keys]


def to_toml(cfg: Config) -> str:
    """`cfg` as a TOML file that `--config` reads back to an equal Config (a run directory's config.toml).
    TOML has no null: a key at none is left out, which reads back as none because every optional key
    defaults to none (a test holds this)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)  # Python's shortest float repr (1e-05, 0.1) is valid TOML and reads back exactly
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        # JSON string escapes are TOML basic-string escapes; DEL is the one control TOML wants escaped too.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")

    top, tables = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            rows = [f"{g.name} = {value(x)}" for g in dataclasses.fields(v) if (x := getattr(v, g.name)) is not None]
            tables.append(f"[{f.name}]\n" + "".join(r + "\n" for r in rows))
        elif v is not None:
            top.append(f"{f.name} = {value(v)}\n")
    return "".join(top) + "\n" + "\n".join(tables)


_ALIASES = {"resume": "checkpoint.resume"}  # short flags for common dotted keys (flag -> key)


def one_of(metadata: Any) -> str:
    """The help suffix naming a field's fixed set of values (its metadata's `choices`: "; one of A, B"), or
    "": as every help text and the configuration reference list them."""
    return f"; one of {', '.join(map(str, metadata['choices']))}" if metadata.get("choices") else ""


def help_text() -> str:
    """Every flag with its type, default and help, grouped by section."""
    rows = [
        (
            None,
            "--config <file>",
            "TOML file with [model] [parallel] [train] [data] [checkpoint] sections, applied first",
        )
    ]
    for key, f in _known_keys(Config).items():
        extra = one_of(f.metadata)
        rows.append(
            (
                key.rpartition(".")[0] or None,
                f"{_flag(key)} <{_type_name(f.type)}>",
                f"{f.metadata['help']} (default: {_format(f.default)}{extra})",
            )
        )
    rows.sort(key=lambda r: r[0] is not None)  # stable: top-level flags (--run-dir) join --config up front
    width = max(len(usage) for _, usage, _ in rows) + 2
    lines = [
        "options: --section.key VALUE or --section.key=VALUE, applied after --config in order "
        "('-' and '_' are interchangeable)"
    ]
    section = None
    for sec, usage, text in rows:
        if sec != section:
            section = sec
            lines += ["", f"[{sec}]"]
        lines.append(f"  {usage:<{width}}{text}")
    return "\n".join(lines)


def _flag(key: str) -> str:
    # Top-level keys read like ordinary CLI flags (--run-dir); dotted keys keep the field spelling.
    return f"--{key}" if "." in key else f"--{key.replace('_', '-')}"


def _format(value: Any) -> str:
    """A default written the way parse_args reads it back (strings quoted to show spaces, e.g. 'def ')."""
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, list) else repr(value)


def _parse_text(flag: str, text: str, tp: Any) -> Any:
    """Parse a command-line string by the field's type."""
    base, optional = _unwrap(tp)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    try:
        if typing.get_origin(base) is list:
            elem = typing.get_args(base)[0]
            return [elem(s) for s in text.split(",")] if text.strip() else []
        if base is bool:
            words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
            return words[text.strip().lower()]
        return base(text)
    except (ValueError, KeyError):
        raise ValueError(f"{flag} expects {_type_name(tp)}, got {text!r}") from None
