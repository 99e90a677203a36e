"""Model registry: `model.name` -> a `ModelSpec` of builder functions (the torchtitan TrainSpec pattern).

The trainer core never imports model code: it asks the registry, which imports `models.<name>` on first use; that
package registers its spec. A fork adds a model by adding a package that calls `register_model_spec`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from trainer.config import option


@dataclass
class ModelSection:
    """Which model to build."""

    name: str = "deepseek_v3"
    """Model family, looked up in the model registry."""
    flavor: str = "debugmodel"
    """Named size preset of the model family (e.g. debugmodel, 16B, 671B)."""
    hf_config_path: str = ""
    """Optional Hugging Face config.json; when set, model args come from it instead of the flavor."""
    n_layers: int = option(0, ge=1, special=0)
    """Number of transformer layers, overriding the flavor's (or the HF config's); 0 = keep it. Cuts a flavor
    to a benchmarkable size with its real layer shapes (train_configs/h100_bench.toml: 16B with 4 layers)."""
    n_dense_layers: int = option(-1, ge=0, special=-1)
    """How many of the first layers use a dense FFN instead of MoE, overriding the flavor's; -1 = keep it. At
    most n_layers."""


@dataclass
class MoESection:
    """Mixture-of-experts training knobs."""

    load_balance_coeff: float = option(1e-3, ge=0)
    """Step size of the aux-loss-free expert-bias update; 0 disables the update."""
    aux_loss_coeff: float = option(0.0, ge=0)
    """Weight of the DeepSeek-V3 sequence-wise balance loss; 0 disables it."""
    use_grouped_mm: bool = True
    """Run the routed experts as one grouped matmul instead of a loop over experts."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one model family.

    build_args(job_config) -> model args for `model.flavor` (or `model.hf_config_path`), adapted to the job
        (seq_len, MoE switches); raises ConfigError for a job the model cannot run.
    model_cls(args) -> nn.Module, built by the trainer on the meta device; it must have `init_weights(device)`.
    parallelize_fn(model, parallel_dims, meshes, job_config) -> model: EP, AC, compile, FSDP in that order.
    pipeline_fn(model, parallel_dims, meshes, job_config, loss_fn) -> (schedule, model_parts, has_first, has_last).
    build_loss_fn(args) -> fn(output, labels) -> summed loss over valid label tokens.
    post_optimizer_step(model_parts, job_config, dp_group) -> dict of scalars to log (e.g. MoE bias update).
    counts(args, seq_len) -> (total params, active params, training FLOPs per token).
    state_dict_adapter: HF checkpoint import/export helpers (module or object), or None.
    """

    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, Any]
    build_args: Callable[[Any], Any]
    parallelize_fn: Callable[..., nn.Module]
    pipeline_fn: Callable[..., Any] | None
    build_loss_fn: Callable[[Any], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    post_optimizer_step: Callable[..., dict[str, float]]
    counts: Callable[[Any, int], tuple[int, int, float]]
    state_dict_adapter: Any = None


_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Make `spec` available under `spec.name` (a later registration of the same name replaces it)."""
    _SPECS[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    """Return the spec of `name`, importing `models.<name>` to let it register itself."""
    if name not in _SPECS:
        try:
            importlib.import_module(f"models.{name}")
        except ModuleNotFoundError as e:
            if e.name not in (f"models.{name}", "models"):
                raise
    if name not in _SPECS:
        raise KeyError(name)
    return _SPECS[name]


def available_models() -> list[str]:
    """Names of the model packages under `models/` (registered or not yet imported)."""
    import pkgutil

    import models

    return sorted({m.name for m in pkgutil.iter_modules(models.__path__)} | set(_SPECS))
