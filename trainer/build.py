"""Building a job's model: on the meta device, split into this rank's pipeline stages, each parallelized by the
model's plan; then, for training, materialised and initialised. The one build path of the trainer, the dry run,
the memory plan and the benchmarks, so none of them can drift from what a run builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from core.model_spec import ModelSpec
from parallelisms.pipeline import StagePlan, plan_stages
from trainer.job_config import JobConfig, parallelize_job

__all__ = ["ModelParts", "build_model_parts", "materialize"]


@dataclass
class ModelParts:
    """This rank's model parts (one, or its pipeline stages in stage order) and, with pipeline parallelism, the
    stage plan they come from."""

    parts: list[nn.Module]
    stage_plan: StagePlan | None

    def stage_names(self) -> list[list[str]]:
        """The module names of each of this rank's parts (["all"] without pipeline parallelism)."""
        if self.stage_plan is None:
            return [["all"]]
        return [self.stage_plan.names[s] for s in self.stage_plan.stage_ids]


def build_model_parts(spec: ModelSpec, args, cfg: JobConfig, dims, meshes) -> ModelParts:
    """Build the model of `args` on the meta device, apply the model's per-job settings (`hooks.configure_model`),
    split it into this rank's pipeline stages when `dims` has pipeline parallelism (the rank's position comes from
    `meshes`), and parallelize each part with the model's plan. Nothing is allocated."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    spec.hooks.configure_model(model, cfg.moe)
    job = parallelize_job(cfg)
    if not dims.pp_enabled:
        return ModelParts([spec.parallelize(model, dims, meshes, job)], None)
    plan = plan_stages(spec.pipeline.units(args), dims.pp, meshes.pp.get_local_rank(), cfg.parallelism)
    parts = [spec.parallelize(spec.pipeline.stage(model, plan.names[s]), dims, meshes, job) for s in plan.stage_ids]
    return ModelParts(parts, plan)


def materialize(parts: list[nn.Module], device: torch.device, seed: int) -> None:
    """Allocate the parts on `device` and initialise them (the same full weights on any layout), in training mode."""
    for part in parts:
        part.to_empty(device=device)
        part.init_weights(buffer_device=device, seed=seed)
        part.train()
