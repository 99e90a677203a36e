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

Callers import from `core.config` only; the modules behind it, one concern each:

- `errors`: `ConfigError` and `run_with_config_errors` (one stderr line, exit status 2).
- `fields`: `option` and its metadata, the schema read from a root dataclass, type coercion of TOML and
  command-line values, `check_fields` and `check_sections`.
- `loading`: `load` (defaults < TOML < command line), did-you-mean suggestions, the file:line of a TOML mistake.
- `render`: the `--help` text from the attribute docstrings (`field_docs`) and `config_to_toml`.
"""

from core.config.errors import ConfigError, run_with_config_errors
from core.config.fields import check_fields, check_sections, option
from core.config.loading import load
from core.config.render import config_to_toml, field_docs

__all__ = [
    "ConfigError",
    "check_fields",
    "check_sections",
    "config_to_toml",
    "field_docs",
    "load",
    "option",
    "run_with_config_errors",
]
