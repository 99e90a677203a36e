"""The user-facing config error and the entry-point wrapper that turns it into one stderr line and exit 2."""

import sys
from collections.abc import Callable
from typing import Any, TypeVar

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
