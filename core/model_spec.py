"""The model spec: everything the trainer needs to know about one model family (the torchtitan TrainSpec pattern),
and the table of registered specs.

A family fills in six required fields and, for each feature it supports, one optional group: training hooks, a
pipeline split, checkpoint formats, the tables its parallelize plan exposes, and what the tools (memory plan,
FLOP split) need. Each hook receives only the config sections it reads (`ModelJob`, `ParallelizeJob`, the `[moe]`
section), never the whole job config.

A model package registers its spec on import (`register_model_spec`); the trainer finds a package by name
(`trainer.registry.get_model_spec`) and never imports model code itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from core.memory_types import Shape, StageMemory
from core.model_config import ModelSection, MoESection
from core.names import ModuleDefaults

__all__ = ["Checkpoints", "HFAdapter", "ModelJob", "ModelSpec", "ParallelizeJob", "PipelineSplit", "PlanTables",
           "ToolHooks", "TrainingHooks", "register_model_spec", "registered_names", "registered_spec"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelJob:
    """What a model family reads of the job to build its args: its own sections and the few settings of the others
    that its checks need."""

    model: ModelSection
    moe: MoESection
    seq_len: int
    expert_parallel_degree: int
    pipeline_parallel_degree: int
    compile_model: bool
    """Whether `[compile]` compiles the model's blocks (not only the loss)."""
    fp8: Any
    """The `[fp8]` section (`quantization.fp8.config.Fp8Section`; quantization sits above core)."""


@dataclass(frozen=True)
class ParallelizeJob:
    """The sections a model's parallelize plan reads (their classes sit above core: parallelisms, quantization)."""

    parallelism: Any
    activation_checkpoint: Any
    compile: Any
    fp8: Any
    dtype: str
    """`training.dtype`: the compute dtype."""
    reduce_dtype: str
    """`training.mixed_precision_reduce`: the dtype FSDP reduces gradients in."""


class BuildArgs(Protocol):
    def __call__(self, job: ModelJob) -> Any:
        """Model args for `model.flavor` (or `model.hf_config_path`), adapted to the job; raises
        `core.config.ConfigError` for a job the model cannot run."""
        ...


class Parallelize(Protocol):
    def __call__(self, model: nn.Module, parallel_dims: Any, meshes: Any, job: ParallelizeJob) -> nn.Module:
        """Apply EP, FP8, AC, compile and FSDP to one model part (a model or pipeline stage) in place and return it."""
        ...


class Counts(Protocol):
    def __call__(self, args: Any, seq_len: int) -> tuple[int, int, float]:
        """(total params, active params, training FLOPs per token)."""
        ...


def _no_configuration(model: nn.Module, moe: MoESection) -> None:
    return None


def _no_step_state(model_parts: list[nn.Module], global_tokens: int) -> None:
    return None


def _no_scalars(model_parts: list[nn.Module], moe: MoESection, dp_group: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class TrainingHooks:
    """Per-job and per-step work on the model that the loop calls; each does nothing by default."""

    configure_model: Callable[[nn.Module, MoESection], None] = _no_configuration
    """(model, moe) -> None: per-job settings on the model just built on the meta device, before it is split or
    parallelized (e.g. the MoE aux-loss weight)."""
    before_step: Callable[[list[nn.Module], int], None] = _no_step_state
    """(model_parts, global_tokens) -> None: per-step state set before the step's first forward, from the number of
    valid label tokens in the global batch (e.g. the aux loss's 1 / global_tokens)."""
    post_optimizer_step: Callable[[list[nn.Module], MoESection, Any], dict[str, Any]] = _no_scalars
    """(model_parts, moe, dp_group) -> scalars to log, after the optimizer step (e.g. the MoE bias update): floats,
    or 0-d device tensors, which the loop reads on its next logging step with its own values in one transfer (a
    read here would make the host wait for the device every step)."""


@dataclass(frozen=True)
class PipelineSplit:
    """How pipeline parallelism splits the model (none: the model runs with pipeline degree 1 only)."""

    units: Callable[[Any], Any]
    """(args) -> `parallelisms.pipeline.SplitUnits`: the module names the pipeline balances over its stages, in
    forward order, with the first and the last stage's units."""
    stage: Callable[[nn.Module, list[str]], nn.Module]
    """(model, names) -> a copy of the (meta) model holding only the modules in `names` (parameter names stay those
    of the full model)."""


class HFAdapter(Protocol):
    """Hugging Face checkpoint import for a model family."""

    def compare_checkpoint(self, path: str | Path, args: Any) -> tuple[dict[str, str], list[str], dict]:
        """({hub key: our key} the checkpoint lacks, [hub keys the model has no place for], {hub key: (its shape,
        the model's)}), from the checkpoint's index and headers only."""
        ...

    def read_hf_state_dict(self, path: str | Path, args: Any, dtype: torch.dtype | None = torch.float32,
                           progress: bool = False, partial: bool = False) -> dict[str, torch.Tensor]:
        """Our full state dict streamed from the checkpoint (`partial`: only what matches in name and shape)."""
        ...


@dataclass(frozen=True)
class Checkpoints:
    """Checkpoint formats beyond the trainer's own (DCP)."""

    hf: HFAdapter | None = None
    """Import of Hugging Face checkpoints (`checkpoint.initial_load_in_hf`); None: not supported."""
    optional_weights: Mapping[str, str] = field(default_factory=dict)
    """{state_dict key prefix: the config setting that builds the model without those weights}, e.g.
    {"mtp.": "--model.mtp_layers 0"}: named when a checkpoint lacks such weights."""


@dataclass(frozen=True)
class PlanTables:
    """What the model's parallelize plan exposes to the config checks and the trainer's log."""

    recompute_modules: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    """The names `activation_checkpoint.recompute_modules` accepts, each mapped to the
    `parallelisms.activation_checkpoint.policy.ScopeRule`s it stands for; checked before the model is built."""
    module_defaults: ModuleDefaults = ModuleDefaults()
    """The model's module names where `fp8.modules`, `fp8.exclude_modules` or
    `activation_checkpoint.force_recompute_modules` say "default" (`core.names`)."""
    compile_units: Callable[[nn.Module], list] | None = None
    """(model part) -> the `parallelisms.compile.CompileUnit`s the plan compiles; None: never compiled."""


class MemoryPlan(Protocol):
    def __call__(self, args: Any, moe: MoESection, fp8: Any, shape: Shape, names: list[str] | None,
                 gather_bytes: int, shard: int) -> StageMemory:
        """The tensors and sizes of the model part holding the pipeline units `names` (None: all) for one
        microbatch of `shape`, FSDP gathering `gather_bytes` per element over `shard` ranks."""
        ...


@dataclass(frozen=True)
class ToolHooks:
    """What the tools need beyond training: the memory plan and the FLOP split of FP8."""

    memory_plan: MemoryPlan | None = None
    """The model side of `python -m trainer.memory_plan`; None: no memory plan."""
    module_flops: Callable[[Any], dict[str, float]] | None = None
    """(args) -> {block-relative FQN: training FLOPs per token} of every module the `[fp8]` section can convert,
    summed over the blocks (`quantization.fp8.accounting.fp8_flops_per_token`); None: unknown."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one model family: six required fields, then the optional groups.

    model_cls(args) -> nn.Module, built on the meta device; it must have `init_weights(buffer_device, seed)`.
    build_loss_fn(args) -> fn(output, labels) -> summed loss over valid label tokens. A family with
    `context_parallel` is also called `build_loss_fn(args, context_parallel)` when sequences are split
    (`parallelisms.context_parallel.ContextParallel`): its loss then gets the whole sequences' labels and this rank's
    share of the outputs.
    """

    name: str
    model_cls: type[nn.Module]
    build_args: BuildArgs
    parallelize: Parallelize
    build_loss_fn: Callable[[Any], LossFn]
    param_and_flop_counts: Counts
    hooks: TrainingHooks = TrainingHooks()
    pipeline: PipelineSplit | None = None
    checkpoints: Checkpoints = Checkpoints()
    plan: PlanTables = PlanTables()
    tools: ToolHooks = ToolHooks()
    context_parallel: bool = False
    """The family can split sequences over ranks (`parallelism.context_parallel_degree`): its model takes the
    whole sequences' tokens and its parallelize plan gives the model the rank's `ContextParallel`."""


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
