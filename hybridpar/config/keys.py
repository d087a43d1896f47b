"""Dotted keys ('train.lr', or 'run_dir' at top level) and field types, shared by validation, the
dict/TOML loader and the command-line parser so that all three name and type-check keys alike."""

import dataclasses
import difflib
import types
import typing
from dataclasses import fields
from typing import Any

# Keys this version no longer has, each with the one line that says what to use instead. A config a
# user writes (a file, a flag) that sets one is refused with it; a config a run wrote (config.toml,
# trainer_state.json) has them dropped: it records what an older version did and asks for nothing.
RETIRED: dict[str, str] = {
    "data.max_bytes": (
        "data.max_bytes is gone (it capped the corpus silently, at 16 MB by default): the whole corpus is used "
        "unless data.max_tokens N asks for its first N tokens (for byte-level text a token is a byte, so the "
        "same N keeps the same corpus); set that instead, or drop the key"
    ),
}


def _is_num(v: Any, kinds: tuple[type, ...] = (int, float)) -> bool:
    return isinstance(v, kinds) and not isinstance(v, bool)  # bool is an int subclass, but True is not a number


def _is_int(v: Any) -> bool:
    return _is_num(v, (int,))


def _known_keys(root: type) -> dict[str, dataclasses.Field]:
    """Every settable leaf of the dataclass `root` (Config): dotted key -> field, in declaration order.
    `root` is a parameter rather than an import so this module stays below config.py."""
    out: dict[str, dataclasses.Field] = {}
    for f in fields(root):
        if dataclasses.is_dataclass(f.type):
            out.update({f"{f.name}.{g.name}": g for g in fields(f.type)})
        else:
            out[f.name] = f
    return out


def _owner(cfg: Any, key: str) -> tuple[Any, str]:
    """'train.lr' -> (cfg.train, 'lr'); 'run_dir' -> (cfg, 'run_dir'): the getattr/setattr target."""
    section, _, name = key.rpartition(".")
    return (getattr(cfg, section) if section else cfg), name


def _suggest(word: str, options: typing.Iterable[str], show: typing.Callable[[str], str] = repr) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _unwrap(tp)
    name = f"list[{typing.get_args(base)[0].__name__}]" if typing.get_origin(base) is list else base.__name__
    return f"{name} or none" if optional else name
