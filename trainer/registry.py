"""Model registry: `model.name` -> a `ModelSpec` of builder functions (the torchtitan TrainSpec pattern).

The trainer core never imports model code: it asks the registry, which imports `models.<name>` on first use; that
package registers its spec. A fork adds a model by adding a package that calls `register_model_spec`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import models
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
    mtp_layers: int = option(-1, ge=0, special=-1)
    """Multi-token-prediction layers: -1 = as the flavor (or the HF config's num_nextn_predict_layers) says, 0 =
    none, N = that depth. A checkpoint saved by transformers declares MTP in config.json but stores no MTP weights:
    train from it with 0."""


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
    build_loss_fn(args) -> fn(output, labels) -> summed loss over valid label tokens.
    post_optimizer_step(model_parts, job_config, dp_group) -> dict of scalars to log (e.g. MoE bias update).
    counts(args, seq_len) -> (total params, active params, training FLOPs per token).
    state_dict_adapter: HF checkpoint import/export helpers (module or object), or None.
    recompute_modules: the names `activation_checkpoint.recompute_modules` accepts, each mapped to the
        `parallelisms.activation_checkpoint.ScopeRule`s it stands for (the model's submodule names); the config
        checks names against it before the model is built.
    compile_units(model_part) -> the `parallelisms.compile.CompileUnit`s that `parallelize_fn` compiles, or None
        when the model is never compiled; the trainer's compile-time estimate counts them.
    configure_model(model, job_config) -> None: per-job settings on the model just built on the meta device, before
        it is split or parallelized (e.g. the MoE aux-loss weight); no-op by default.
    before_step(model_parts, global_tokens) -> None: per-step state set before the step's first forward, from the
        number of valid label tokens in the global batch (e.g. the aux loss's 1 / global_tokens); no-op by default.
    pipeline_units(args) -> `parallelisms.pipeline.SplitUnits`: the module names the pipeline balances over its
        stages, in forward order, with the first and the last stage's units; None: no pipeline parallelism.
    pipeline_stage(model, names) -> nn.Module: a copy of the (meta) model holding only the modules in `names`
        (the parameter names stay those of the full model); given with `pipeline_units`.
    memory_plan(args, job_config, shape, names, gather_bytes, shard) -> `trainer.memory_plan.StageMemory`: the
        tensors and sizes of the model part holding the pipeline units `names` (None: all) for one microbatch of
        `shape`, FSDP gathering `gather_bytes` per element over `shard` ranks; None: no memory plan.
    module_flops(args) -> {block-relative FQN: training FLOPs per token} of every module the `[fp8]` section can
        convert (the names `parallelisms.fp8.fp8_block_modules` finds in the blocks), summed over the blocks: the
        part of `counts`' FLOPs that a recipe may run as FP8 GEMMs (`parallelisms.fp8.fp8_flops_per_token`);
        None: that part is unknown.
    optional_weights: {state_dict key prefix: the config setting that builds the model without those weights},
        e.g. {"mtp.": "--model.mtp_layers 0"}: named when a checkpoint lacks such weights.
    """

    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, Any]
    build_args: Callable[[Any], Any]
    parallelize_fn: Callable[..., nn.Module]
    build_loss_fn: Callable[[Any], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    post_optimizer_step: Callable[..., dict[str, float]]
    counts: Callable[[Any, int], tuple[int, int, float]]
    state_dict_adapter: Any = None
    recompute_modules: Mapping[str, Any] = field(default_factory=dict)
    compile_units: Callable[[nn.Module], list] | None = None
    configure_model: Callable[[nn.Module, Any], None] = lambda model, job_config: None
    before_step: Callable[[list[nn.Module], int], None] = lambda model_parts, global_tokens: None
    pipeline_units: Callable[[Any], Any] | None = None
    pipeline_stage: Callable[[nn.Module, list[str]], nn.Module] | None = None
    memory_plan: Callable[..., Any] | None = None
    module_flops: Callable[[Any], dict[str, float]] | None = None
    optional_weights: Mapping[str, str] = field(default_factory=dict)


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
    return sorted({m.name for m in pkgutil.iter_modules(models.__path__)} | set(_SPECS))
