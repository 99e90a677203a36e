"""The registry of MoE communication backends: `parallelism.expert_parallel_comm_backend` name -> dispatcher class.

A backend registers itself where it is defined::

    @register_comm_backend("alltoall")
    class AllToAllDispatcher(TokenDispatcher):
        ...

and everything else asks the registry: the config's choices (`COMM_BACKENDS`), expert parallelism
(`get_comm_backend(name)(group, num_experts)`), the config validation (`config_problem`), the train loop's
metrics (`metrics`), and activation checkpointing, whose op table (`op_table()`) is derived from the backends
registered when it is read. The built-in backends register when `parallelisms.moe_comm` is imported;
docs/architecture.md shows how to add one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MappingProxyType
from typing import TypeVar

from core.token_dispatch import TokenDispatcher
from parallelisms.activation_checkpoint.ops import OpTable

__all__ = ["COMM_BACKENDS", "get_comm_backend", "op_table", "register_comm_backend"]

D = TypeVar("D", bound=type[TokenDispatcher])

_BACKENDS: dict[str, type[TokenDispatcher]] = {}
#: Live, read-only view of the registered backends by name (a backend registered later shows up at once).
COMM_BACKENDS = MappingProxyType(_BACKENDS)


def register_comm_backend(name: str) -> Callable[[D], D]:
    """Class decorator: make the TokenDispatcher subclass available as `expert_parallel_comm_backend = name`.

    Registering the same class again is a no-op (a module imported twice); another class under a taken name, or a
    backend whose `ac_ops` names clash with the op table's, is a ValueError and is not registered.
    """

    def register(cls: D) -> D:
        if not (isinstance(cls, type) and issubclass(cls, TokenDispatcher)):
            raise TypeError(f"comm backend {name!r}: {cls!r} is not a TokenDispatcher subclass")
        current = _BACKENDS.get(name)
        if current is cls:
            return cls
        if current is not None:
            raise ValueError(f"comm backend {name!r} is already registered by {current.__qualname__}")
        OpTable([*_BACKENDS.values(), cls])  # raises on a clash of op names
        _BACKENDS[name] = cls
        return cls

    return register


def get_comm_backend(name: str) -> type[TokenDispatcher]:
    """The dispatcher class registered as `name`; ValueError naming the registered ones if there is none."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown expert_parallel_comm_backend {name!r}; registered: "
                         f"{', '.join(_BACKENDS)}") from None


def op_table() -> OpTable:
    """The activation-checkpointing op table of the backends registered now (one table per set of backends)."""
    return _op_table(tuple(_BACKENDS.values()))


@functools.cache
def _op_table(backends: tuple[type[TokenDispatcher], ...]) -> OpTable:
    return OpTable(backends)
