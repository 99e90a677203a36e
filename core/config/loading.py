"""Loading a root config: defaults < the TOML file < command-line overrides (`load`), with did-you-mean
suggestions for unknown names and the file:line of the TOML key behind a mistake."""

import contextlib
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

from core.config.errors import ConfigError
from core.config.fields import _Key, _coerce, _expected, _fields, _parse_cli_value, _sections, check_fields
from core.config.render import help_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------
# Name lookup with suggestions


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


# ---------------------------------------------------------------------------------------------------------
# TOML reading


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


# ---------------------------------------------------------------------------------------------------------
# Entry point


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
