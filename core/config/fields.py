"""Field metadata and value checks: `option`, the schema read from a root dataclass, type coercion of TOML and
command-line values, and the per-field and per-section checks (`check_fields`, `check_sections`).

The underscore names (`_Key`, `_sections`, `_fields`, `_allowed`, `_expected`, `_coerce`, `_parse_cli_value`,
`_TYPE_NAMES`) are shared with the sibling modules `loading` and `render`; they are not part of `core.config`.
"""

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Sequence
from dataclasses import field
from typing import Any

from core.config.errors import ConfigError


def option(
    default: Any,
    *,
    choices: Sequence[Any] | None = None,
    item_choices: Sequence[str] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    special: int | None = None,
    cli_only: bool = False,
) -> Any:
    """A section field whose allowed values are data that the loader enforces.

    `special` is one sentinel value (e.g. -1 = "auto") accepted outside the numeric bounds. `cli_only` marks
    fields that describe this invocation rather than the job; they are rejected in a TOML file and left out
    of `config_to_toml`.
    """
    meta = {
        "choices": choices,
        "item_choices": item_choices,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "special": special,
        "cli_only": cli_only,
    }
    # Identity tests: a bound of 0 compares equal to False and must survive.
    meta = {k: v for k, v in meta.items() if v is not None and v is not False}
    if isinstance(default, list):
        # A fresh list per instance: configs must never share mutable defaults.
        return field(default_factory=functools.partial(list, default), metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------------------------------------------------
# Schema introspection


@dataclasses.dataclass(frozen=True)
class _Key:
    """One section field as the loader sees it: its resolved type and its `option` metadata."""

    type: Any
    metadata: Any


@functools.cache
def _sections(root: type) -> dict[str, type]:
    """Section name -> section dataclass of the root dataclass `root`, in declaration order."""
    # get_type_hints resolves string annotations (modules with `from __future__ import annotations`).
    hints = typing.get_type_hints(root)
    return {f.name: hints[f.name] for f in dataclasses.fields(root)}


@functools.cache
def _section_keys(cls: type) -> dict[str, _Key]:
    hints = typing.get_type_hints(cls)
    return {f.name: _Key(hints[f.name], f.metadata) for f in dataclasses.fields(cls)}


def _fields(root: type, section: str) -> dict[str, _Key]:
    return _section_keys(_sections(root)[section])


_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", list[str]: "list[str]"}


def _allowed(f: _Key) -> str | None:
    """Human description of the values a field accepts, or None when any value of its type is fine."""
    meta = f.metadata
    if "choices" in meta:
        return ", ".join(str(c) for c in meta["choices"])
    if "item_choices" in meta:
        return "items from " + ", ".join(meta["item_choices"])
    bounds = [
        f"{op} {_fmt_num(meta[k])}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if k in meta
    ]
    if not bounds:
        return None
    text = " and ".join(bounds)
    if "special" in meta:
        text = f"{meta['special']} or {text}"
    return text


def _expected(f: _Key) -> str:
    """What a value of this field looks like, for type errors: e.g. `int >= 1`, `one of float32, bfloat16`."""
    allowed = _allowed(f)
    if f.type is bool:
        return "true or false"
    if "choices" in f.metadata:
        return f"one of {allowed}"
    if f.type == list[str]:
        return "comma-separated " + (allowed if allowed else "strings")
    return f"{_TYPE_NAMES[f.type]} {allowed}" if allowed else _TYPE_NAMES[f.type]


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# ---------------------------------------------------------------------------------------------------------
# Type coercion and value checks


def _coerce(key: str, f: _Key, value: Any) -> Any:
    """Type-check a TOML value (or an already-parsed CLI value) against the field type."""
    want = _TYPE_NAMES[f.type]
    ok = False
    if f.type is bool:
        ok = isinstance(value, bool)
    elif f.type is int:
        # bool is a subclass of int in Python; `steps = true` is still a mistake.
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif f.type is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(key, f"expected a finite float, got {value!r}", _expected(f))
    elif f.type is str:
        ok = isinstance(value, str)
    elif f.type == list[str]:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if ok:
            value = list(value)
    if not ok:
        raise ConfigError(key, f"expected {want}, got {value!r} ({type(value).__name__})", _expected(f))
    return value


_INT_RE = re.compile(r"[+-]?\d+")
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _parse_cli_value(key: str, f: _Key, raw: str) -> Any:
    """Parse one command-line string strictly into the field type (no `1_000`, no `yes`)."""
    want = _TYPE_NAMES[f.type]
    if f.type is bool:
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
    elif f.type is int:
        if _INT_RE.fullmatch(raw):
            return int(raw)
    elif f.type is float:
        if _FLOAT_RE.fullmatch(raw):
            return float(raw)
    elif f.type is str:
        return raw
    elif f.type == list[str]:
        if raw == "":
            return []
        items = [item.strip() for item in raw.split(",")]
        if any(not item for item in items):
            raise ConfigError(key, f"empty item in list {raw!r}", "comma-separated names, e.g. a,b,c")
        return items
    raise ConfigError(key, f"expected {want}, got {raw!r}", _expected(f))


def _check_field(key: str, f: _Key, value: Any) -> None:
    """Enforce the choices and bounds stored in the field metadata."""
    meta = f.metadata
    allowed = _allowed(f)
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(key, f"{value!r} is not a valid choice", allowed)
    if "item_choices" in meta:
        for item in value:
            if item not in meta["item_choices"]:
                raise ConfigError(key, f"{item!r} is not a valid item", ", ".join(meta["item_choices"]))
    if "special" in meta and value == meta["special"]:
        return
    out_of_range = (
        ("ge" in meta and value < meta["ge"])
        or ("gt" in meta and value <= meta["gt"])
        or ("le" in meta and value > meta["le"])
        or ("lt" in meta and value >= meta["lt"])
    )
    if out_of_range:
        raise ConfigError(key, f"{value!r} is out of range", allowed)


def check_fields(cfg: Any) -> None:
    """Check every field of the root config `cfg` against its type, choices and bounds; raises ConfigError on the
    first violation.

    `load` runs this; call it yourself on a config built or edited in code.
    """
    root = type(cfg)
    for section in _sections(root):
        obj = getattr(cfg, section)
        for name, f in _fields(root, section).items():
            key = f"{section}.{name}"
            _check_field(key, f, _coerce(key, f, getattr(obj, name)))


# ---------------------------------------------------------------------------------------------------------
# Section checks


def check_sections(cfg: Any) -> None:
    """Run each section's own `check()` (when it has one); raises the first problem found as a ConfigError.

    A section's `check()` returns ConfigErrors keyed relative to the section (`initial_load_in_hf`); the key
    is reported under the section's name in `cfg` (`checkpoint.initial_load_in_hf`). `load` does not run these:
    a config whose sections disagree still loads and prints; the job's validation runs them.
    """
    for section in _sections(type(cfg)):
        check = getattr(getattr(cfg, section), "check", None)
        problems = check() if check is not None else []
        if problems:
            first = problems[0]
            raise ConfigError(f"{section}.{first.key}", first.problem, first.allowed)
