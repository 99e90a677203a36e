"""The registry of MoE communication backends: `parallelism.expert_parallel_comm_backend` name -> dispatcher class.

A backend registers itself where it is defined::

    @register_comm_backend("alltoall")
    class AllToAllDispatcher(TokenDispatcher):
        ...

and everything else asks the registry: the config's choices (`COMM_BACKENDS`), expert parallelism
(`get_comm_backend(name)(group, num_experts)`), the config validation (`config_problem`), the train loop's
metrics (`metrics`). Activation checkpointing listens (`on_register`) to add the ops a backend contributes to its
op table. The built-in backends register when `parallelisms.moe_comm` is imported; docs/architecture.md shows how
to add one.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import TypeVar

from models.common.token_dispatch import TokenDispatcher

__all__ = ["COMM_BACKENDS", "backend_save_ops", "get_comm_backend", "on_register", "register_comm_backend"]

D = TypeVar("D", bound=type[TokenDispatcher])

_BACKENDS: dict[str, type[TokenDispatcher]] = {}
#: Live, read-only view of the registered backends by name (a backend registered later shows up at once).
COMM_BACKENDS = MappingProxyType(_BACKENDS)
_LISTENERS: list[Callable[[type[TokenDispatcher]], None]] = []


def register_comm_backend(name: str) -> Callable[[D], D]:
    """Class decorator: make the TokenDispatcher subclass available as `expert_parallel_comm_backend = name`.

    Registering the same class again is a no-op (a module imported twice); another class under a taken name is
    a ValueError. The listeners (`on_register`) run before the name becomes visible, so a backend whose ops clash
    with the op table is not registered at all.
    """

    def register(cls: D) -> D:
        if not (isinstance(cls, type) and issubclass(cls, TokenDispatcher)):
            raise TypeError(f"comm backend {name!r}: {cls!r} is not a TokenDispatcher subclass")
        current = _BACKENDS.get(name)
        if current is cls:
            return cls
        if current is not None:
            raise ValueError(f"comm backend {name!r} is already registered by {current.__qualname__}")
        for listener in _LISTENERS:
            listener(cls)
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


def on_register(listener: Callable[[type[TokenDispatcher]], None]) -> None:
    """Call `listener(cls)` for every backend registered so far and for each one registered later."""
    _LISTENERS.append(listener)
    for cls in _BACKENDS.values():
        listener(cls)


def backend_save_ops() -> list[str]:
    """The op-table names every registered backend contributes (`TokenDispatcher.ac_ops`), in registration order."""
    return [name for cls in _BACKENDS.values() for name in cls.ac_ops]
