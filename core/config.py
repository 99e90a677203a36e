"""Config machinery shared by every section: `ConfigError`, `option`, and loading from defaults < TOML < CLI.

Standard library only, so any package may import it (`parallelisms/` and `models/` included). It knows no
section: each section is a dataclass that lives beside the code that reads it, and the job's root dataclass
(`trainer.job_config.JobConfig`) has one field per section. Every function here works on such a root.

A section field carries its documentation as an attribute docstring (a string literal on the line after the
field); `--help` reads those docstrings from the section's source, so the help text and the code cannot drift
apart. Allowed values live in field metadata (`option(choices=..., ge=...)`) and one generic checker enforces
them, so adding a knob means adding one field, not another `if`. A section may define `check(self)` returning
the mistakes that compare its own keys (as ConfigErrors keyed relative to the section); `check_sections` runs
them.
"""

import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import math
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(Exception):
    """A user-facing config mistake, rendered as one line: `config error: <key>: <problem>; allowed: ...`.

    `key` names what is wrong (a dotted config key, or `file:line:col` for malformed TOML), `problem` says
    what, and `allowed` (optional) says what would be accepted instead. `where` (optional, `file:line`) is the
    place in a TOML file that set the key; it is printed in front of the key.
    """

    def __init__(self, key: str, problem: str, allowed: str | None = None, where: str | None = None):
        self.key = key
        self.problem = problem
        self.allowed = allowed
        self.where = where
        line = f"config error: {where + ': ' if where else ''}{key}: {problem}"
        if allowed:
            line += f"; allowed: {allowed}"
        # One line on purpose: run_with_config_errors promises a single stderr line, and a TOML decoder
        # message or a path could otherwise smuggle in a newline.
        super().__init__(" ".join(line.split()))


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


@functools.cache
def _class_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of one section dataclass, `{key: doc}`, read from the source of the class."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_docs(root: type) -> dict[str, dict[str, str]]:
    """Attribute docstrings of every section of `root`, `{section: {key: doc}}`, wherever the section lives."""
    return {name: _class_docs(cls) for name, cls in _sections(root).items()}


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
# Name lookup with suggestions


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


def _unknown_section(root: type, name: str) -> ConfigError:
    sections = list(_sections(root))
    hint = difflib.get_close_matches(name, sections, n=1)
    if hint:
        problem = f"unknown section; did you mean {hint[0]}?"
    else:
        # A key written without its section (`steps = 10` at the top of a TOML) is a common slip.
        owners = [s for s in sections if name in _fields(root, s)]
        problem = f"unknown section; did you mean {owners[0]}.{name}?" if owners else "unknown section"
    return ConfigError(name, problem, ", ".join(sections))


def _lookup(root: type, section: str, name: str) -> _Key:
    """The field for `section.name`, or a ConfigError with a did-you-mean suggestion."""
    if section not in _sections(root):
        raise _unknown_section(root, section)
    fields = _fields(root, section)
    if name in fields:
        return fields[name]
    hint = difflib.get_close_matches(name, list(fields), n=1)
    suggestion = f"{section}.{hint[0]}" if hint else None
    if suggestion is None:
        # Right key, wrong section (e.g. training.lr for optimizer.lr).
        owners = [s for s in _sections(root) if name in _fields(root, s)]
        suggestion = f"{owners[0]}.{name}" if owners else None
    if suggestion is None:
        everything = [f"{s}.{k}" for s in _sections(root) for k in _fields(root, s)]
        close = difflib.get_close_matches(f"{section}.{name}", everything, n=1)
        suggestion = close[0] if close else None
    problem = "unknown key" + (f"; did you mean {suggestion}?" if suggestion else "")
    raise ConfigError(f"{section}.{name}", problem, f"keys of [{section}]: " + ", ".join(fields))


# ---------------------------------------------------------------------------------------------------------
# Command line


def _split_cli(root: type, argv: Sequence[str]) -> list[tuple[str, str, Any]]:
    """Parse `--section.key value`, `--section.key=value` and bare boolean flags into typed overrides."""
    overrides: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            raise ConfigError(token, "unexpected argument", "--section.key value or --section.key=value")
        body = token[2:]
        dotted, has_value, raw = body.partition("=")
        section, dot, name = dotted.partition(".")
        if not dot or not section or not name:
            raise ConfigError(token, "expected --section.key", "--section.key value or --section.key=value")
        key = f"{section}.{name}"
        f = _lookup(root, section, name)
        if not has_value:
            if i < len(argv) and not argv[i].startswith("--"):
                raw = argv[i]
                i += 1
            elif f.type is bool:
                raw = "true"
            else:
                raise ConfigError(key, "missing value on the command line", _expected(f))
        overrides.append((section, name, _parse_cli_value(key, f, raw)))
    return overrides


def help_text(root: type, config_file_key: str = "job.config_file") -> str:
    """Every key of `root` as `--section.key (type, default X): docstring`, grouped by section."""
    docs = field_docs(root)
    lines = [f"Options (precedence: defaults < TOML from --{config_file_key} < command line):"]
    for section, cls in _sections(root).items():
        lines.append("")
        lines.append(f"[{section}] {(cls.__doc__ or '').strip()}")
        instance = cls()
        for name, f in _fields(root, section).items():
            default = _toml_value(getattr(instance, name))
            text = docs[section].get(name, "")
            allowed = _allowed(f)
            if allowed:
                text += f" Allowed: {allowed}."
            entry = f"  --{section}.{name} ({_TYPE_NAMES[f.type]}, default {default}): {text}"
            lines.append(textwrap.fill(entry, width=110, subsequent_indent=" " * 6, break_on_hyphens=False))
    lines.append("")
    lines.append("Syntax: --section.key value | --section.key=value; lists as a,b,c (empty = []); booleans as")
    lines.append("true/false, a bare --section.flag means true.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# TOML


def _decode_error_position(err: Exception, text: str) -> tuple[int, int]:
    """Line and column of a TOMLDecodeError: attributes on new Pythons, parsed from the message on 3.11-3.13."""
    lineno, colno = getattr(err, "lineno", None), getattr(err, "colno", None)
    if lineno is not None and colno is not None:
        return lineno, colno
    match = re.search(r"line (\d+), column (\d+)", str(err))
    if match:
        return int(match.group(1)), int(match.group(2))
    # "(at end of document)": the position is just past the last character.
    lines = text.split("\n")
    return len(lines), len(lines[-1]) + 1


def _read_toml(path: str, config_file_key: str) -> tuple[dict[str, Any], str]:
    """The parsed TOML document at `path` (named by the key `config_file_key`) and its text (kept to point later
    errors at a line)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(config_file_key, f"file not found: {path}", "a path to an existing TOML file") from None
    except OSError as err:
        raise ConfigError(config_file_key, f"cannot read {path}: {err.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(path, f"malformed TOML: not UTF-8 at byte {err.start}") from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as err:
        lineno, colno = _decode_error_position(err, text)
        # Strip the position suffix the 3.11 decoder appends; it is now in the key as file:line:col.
        reason = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)$", "", str(err))
        raise ConfigError(
            f"{path}:{lineno}:{colno}", f"malformed TOML at line {lineno}, column {colno}: {reason}"
        ) from None


_TOML_KEY_PART = r"""[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*'"""
_TOML_DOTTED_KEY = rf"(?:{_TOML_KEY_PART})(?:\s*\.\s*(?:{_TOML_KEY_PART}))*"
_TOML_TABLE_LINE = re.compile(rf"\s*\[\s*({_TOML_DOTTED_KEY})\s*\]")
_TOML_KEY_LINE = re.compile(rf"\s*({_TOML_DOTTED_KEY})\s*=")


def _key_parts(dotted: str) -> tuple[str, ...]:
    return tuple(part.strip("\"'") for part in re.findall(_TOML_KEY_PART, dotted))


def _toml_key_line(text: str, key_path: tuple[str, ...]) -> int | None:
    """1-based line of the TOML `text` that sets `key_path` (`(section,)` or `(section, key)`), or None.

    tomllib reports no positions for keys, so the lines are scanned: a table header sets the current table (and
    is the line of a section or key it starts with), and a key line matches when its full dotted path and
    `key_path` agree as far as both go (`training = { ... }` sets training.steps, `optimizer.training.x = 1` sets
    optimizer.training). Lines inside multi-line strings are not told apart; the first match wins.
    """
    table: tuple[str, ...] = ()
    for lineno, line in enumerate(text.split("\n"), 1):
        header = _TOML_TABLE_LINE.match(line)
        if header:
            table = _key_parts(header.group(1))
            if table[:len(key_path)] == key_path:
                return lineno
            continue
        key = _TOML_KEY_LINE.match(line)
        if key:
            full = table + _key_parts(key.group(1))
            depth = min(len(full), len(key_path))
            if full[:depth] == key_path[:depth]:
                return lineno
    return None


@contextlib.contextmanager
def _located(path: str, text: str, key_path: tuple[str, ...]):
    """Re-raise a ConfigError about `key_path` with the file and line of the TOML text that set it."""
    try:
        yield
    except ConfigError as err:
        line = _toml_key_line(text, key_path)
        where = f"{path}:{line}" if line is not None else path
        raise ConfigError(err.key, err.problem, err.allowed, where=where) from None


def _toml_values(root: type, doc: dict[str, Any], path: str, text: str) -> dict[str, dict[str, Any]]:
    """Check a parsed TOML document against the schema and return `{section: {key: typed value}}`.

    A mistake is reported with the file `path` and the line of `text` where the offending key is set.
    """
    values: dict[str, dict[str, Any]] = {}
    for section, table in doc.items():
        with _located(path, text, (section,)):
            if section not in _sections(root):
                raise _unknown_section(root, section)
            if not isinstance(table, dict):
                raise ConfigError(section, f"expected a table [{section}], got {table!r}", f"[{section}] with keys")
        for name, value in table.items():
            key = f"{section}.{name}"
            with _located(path, text, (section, name)):
                f = _lookup(root, section, name)
                if f.metadata.get("cli_only"):
                    raise ConfigError(key, "can only be set on the command line", f"--{key} on the command line")
                values.setdefault(section, {})[name] = _coerce(key, f, value)
    return values


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            # TOML forbids raw control characters in basic strings.
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        # repr of a finite float is a valid TOML float (e.g. 0.0008, 1e-08) and round-trips exactly.
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")


def config_to_toml(cfg: Any) -> str:
    """Render `cfg` as a TOML document that `load` reads back to an equal config.

    Command-line-only fields (job.config_file, job.print_config) are left out: they describe one invocation,
    and the loader sets job.config_file to the path it actually read.
    """
    root = type(cfg)
    lines = ["# Merged job config (defaults < TOML < command line). Load it with --job.config_file PATH."]
    for section in _sections(root):
        lines.append("")
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        for name, f in _fields(root, section).items():
            if not f.metadata.get("cli_only"):
                lines.append(f"{name} = {_toml_value(getattr(obj, name))}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Entry points


def load(root: type[T], argv: Sequence[str], config_file_key: str = "job.config_file") -> T:
    """Build a `root` config from dataclass defaults < the TOML named by `--<config_file_key>` < CLI overrides.

    `--help`/`-h` anywhere prints every key and raises SystemExit(0). Mistakes raise ConfigError. Only each
    value is checked here (type, choices, bounds); `check_sections` and the job's cross-section checks come later.
    """
    if "--help" in argv or "-h" in argv:
        print(help_text(root, config_file_key))
        raise SystemExit(0)
    overrides = _split_cli(root, argv)
    config_file = ""
    for section, name, value in overrides:
        if f"{section}.{name}" == config_file_key:
            config_file = value
    values: dict[str, dict[str, Any]] = {}
    if config_file:
        doc, text = _read_toml(config_file, config_file_key)
        values = _toml_values(root, doc, config_file, text)
    for section, name, value in overrides:
        values.setdefault(section, {})[name] = value
    cfg = root(**{section: cls(**values.get(section, {})) for section, cls in _sections(root).items()})
    check_fields(cfg)
    return cfg


def run_with_config_errors(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call `fn(*args, **kwargs)`; on ConfigError print its one line to stderr and exit with status 2.

    Entry points wrap their main with this so a config mistake ends the run with a readable line instead of
    a traceback. Other exceptions propagate untouched.
    """
    try:
        return fn(*args, **kwargs)
    except ConfigError as err:
        message = str(err)
    # Exit outside the except block so the SystemExit carries no chained ConfigError context.
    print(message, file=sys.stderr)
    raise SystemExit(2)
