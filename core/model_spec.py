"""The model spec: everything the trainer needs to know about one model family (the torchtitan TrainSpec pattern),
and the table of registered specs.

A model package registers its spec on import (`register_model_spec`); the trainer finds a package by name
(`trainer.registry.get_model_spec`) and never imports model code itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from core.names import ModuleDefaults

__all__ = ["ModelSpec", "register_model_spec", "registered_names", "registered_spec"]


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
        `parallelisms.activation_checkpoint.policy.ScopeRule`s it stands for (the model's submodule names); the config
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
    memory_plan(args, job_config, shape, names, gather_bytes, shard) -> `core.memory_types.StageMemory`: the
        tensors and sizes of the model part holding the pipeline units `names` (None: all) for one microbatch of
        `shape`, FSDP gathering `gather_bytes` per element over `shard` ranks; None: no memory plan.
    module_flops(args) -> {block-relative FQN: training FLOPs per token} of every module the `[fp8]` section can
        convert (the names `quantization.fp8.config.fp8_block_modules` finds in the blocks), summed over the blocks: the
        part of `counts`' FLOPs that a recipe may run as FP8 GEMMs (`quantization.fp8.accounting.fp8_flops_per_token`);
        None: that part is unknown.
    optional_weights: {state_dict key prefix: the config setting that builds the model without those weights},
        e.g. {"mtp.": "--model.mtp_layers 0"}: named when a checkpoint lacks such weights.
    module_defaults: the model's own module names where `fp8.modules`, `fp8.exclude_modules` or
        `activation_checkpoint.force_recompute_modules` say "default" (`core.names`).
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
    module_defaults: ModuleDefaults = ModuleDefaults()


_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Make `spec` available under `spec.name` (a later registration of the same name replaces it)."""
    _SPECS[spec.name] = spec


def registered_spec(name: str) -> ModelSpec | None:
    """The spec registered under `name`, or None."""
    return _SPECS.get(name)


def registered_names() -> list[str]:
    """Names of the registered specs."""
    return list(_SPECS)
