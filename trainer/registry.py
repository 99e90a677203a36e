"""Model discovery: `model.name` -> the `ModelSpec` its package registers (`core.model_spec`).

The trainer core never imports model code: it asks here, and this module imports `models.<name>` on first use;
that package registers its spec. A fork adds a model by adding a package that calls `register_model_spec`.
"""

from __future__ import annotations

import importlib
import pkgutil

import models
from core.model_spec import ModelSpec, registered_names, registered_spec

__all__ = ["available_models", "get_model_spec"]


def get_model_spec(name: str) -> ModelSpec:
    """Return the spec of `name`, importing `models.<name>` to let it register itself."""
    if registered_spec(name) is None:
        try:
            importlib.import_module(f"models.{name}")
        except ModuleNotFoundError as e:
            if e.name not in (f"models.{name}", "models"):
                raise
    spec = registered_spec(name)
    if spec is None:
        raise KeyError(name)
    return spec


def available_models() -> list[str]:
    """Names of the model packages under `models/` (registered or not yet imported)."""
    return sorted({m.name for m in pkgutil.iter_modules(models.__path__)} | set(registered_names()))
