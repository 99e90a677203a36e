"""The one rule by which config keys name a model's modules (`fp8.modules`, `fp8.exclude_modules`,
`activation_checkpoint.force_recompute_modules`), and the "default" entry that stands for the model's own choice.

A name is one or more dotted components of a module's name relative to its block ("attention", "wo",
"moe.experts", "moe.router.gate"). It denotes every module whose block-relative name ends with those components,
and it covers those modules and everything inside them: "attention" denotes the block's attention module and
covers its projections ("attention.wq_a"), "gate" denotes "moe.router.gate". Equivalently, a module is covered
when the name's components appear as a contiguous run of its own name's components.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT = "default"
"""An entry of a module-name list that stands for the model's defaults for that key (`ModuleDefaults`)."""


def denotes(fqn: str, name: str) -> bool:
    """Whether `name` denotes the module with block-relative name `fqn` (its components end `fqn`'s)."""
    return fqn == name or fqn.endswith("." + name)


def covers(fqn: str, name: str) -> bool:
    """Whether `name` covers the module `fqn`: it denotes `fqn` or one of the modules `fqn` sits in."""
    return f".{name}." in f".{fqn}."


def covered_by_any(fqn: str, names: Iterable[str]) -> bool:
    """Whether any of `names` covers `fqn`."""
    return any(covers(fqn, name) for name in names)


def resolve(names: Sequence[str], defaults: Sequence[str]) -> list[str]:
    """`names` with each `DEFAULT` entry replaced by `defaults` (the model's), duplicates dropped, order kept."""
    out: list[str] = []
    for name in names:
        for resolved in (defaults if name == DEFAULT else (name,)):
            if resolved not in out:
                out.append(resolved)
    return out


@dataclass(frozen=True)
class ModuleDefaults:
    """A model's own choices for the config keys that name its modules, used where the key's list says
    `DEFAULT` (the default of each key). Names follow this module's rule."""

    fp8_modules: tuple[str, ...] = ()
    """What `fp8.modules` converts by default (e.g. every linear and the routed experts of a block)."""
    fp8_exclude_modules: tuple[str, ...] = ()
    """What `fp8.exclude_modules` leaves out by default (e.g. a linear whose dims are not multiples of the tile)."""
    force_recompute_modules: tuple[str, ...] = ()
    """What selective AC recomputes by default although `save_ops` names its ops (e.g. a tiny router GEMM)."""
