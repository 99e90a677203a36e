"""Text rendered from the schema: the attribute docstrings (`field_docs`), the `--help` text and the merged
config as a TOML document (`config_to_toml`)."""

import ast
import functools
import inspect
import textwrap
from typing import Any

from core.config.fields import _TYPE_NAMES, _allowed, _fields, _sections


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
# TOML rendering


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
