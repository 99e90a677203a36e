"""Pipeline parallelism: split the model into stages by layers and run them with a `torch.distributed.pipelining`
schedule.

Split: the model's units are `tok_embeddings`, `layers.0` ... `layers.{L-1}`, and `norm output`; the embedding and
the head each count as one layer when balancing stages. Each stage is a deep copy of the (meta-device) model with
the other units removed (`tok_embeddings`/`norm`/`output` set to None, blocks deleted from the `layers` dict), so
parameter names stay those of the full model. Stage s of S runs on pipeline rank s % pp for looped schedules, and
on rank s or 2*pp-1-s for V-shaped ones (ZBVZeroBubble, DualPipeV).

The loss runs on the last stage only; schedules call it per microbatch, and the trainer divides by the global
number of tokens, so gradients do not need the schedule's own scaling (`scale_grads=False`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

SINGLE_STAGE = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
LOOPED = {"Interleaved1F1B": ScheduleInterleaved1F1B}
V_SHAPED = {"ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}


def stages_per_rank(schedule: str, n_layers: int, pp: int, layers_per_stage: int) -> int:
    """1 for single-stage schedules, 2 for V-shaped ones; looped schedules derive it from layers_per_stage."""
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    if layers_per_stage > 0:
        return max(1, -(-(n_layers + 2) // (layers_per_stage * pp)))
    return 2


def split_module_names(n_layers: int, n_stages: int) -> list[list[str]]:
    """Units per stage, balanced with the embedding and the head counted as one layer each."""
    units = ["tok_embeddings"] + [f"layers.{i}" for i in range(n_layers)] + ["norm output"]
    if n_stages > len(units):
        raise ValueError(f"{n_stages} pipeline stages for only {len(units)} units (embedding, layers, head)")
    base, extra = divmod(len(units), n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(" ".join(units[start:start + size]).split())
        start += size
    return out


def stage_ids_of_rank(pp_rank: int, pp: int, n_stages: int, v_shape: bool) -> list[int]:
    """Global stage indices this pipeline rank runs."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp))


def extract_stage(model: nn.Module, keep: list[str]) -> nn.Module:
    """A copy of the (meta) model holding only the units in `keep`."""
    part = copy.deepcopy(model)
    if "tok_embeddings" not in keep:
        part.tok_embeddings = None
    for layer_id in list(part.layers.keys()):
        if f"layers.{layer_id}" not in keep:
            del part.layers[layer_id]
    if "norm" not in keep:
        part.norm = None
    if "output" not in keep:
        part.output = None
    return part


def stage_owner(stage_id: int, pp: int, v_shape: bool) -> int:
    """Pipeline rank that runs `stage_id` (inverse of `stage_ids_of_rank`)."""
    if v_shape and stage_id >= pp:
        return 2 * pp - 1 - stage_id
    return stage_id % pp


@dataclass
class Pipeline:
    """This rank's view of the pipeline: its stage modules (in stage order), the schedule, the layout."""

    schedule: object
    parts: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    v_shape: bool
    group: object

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, hidden_shape: tuple[int, ...]) -> torch.Tensor | None:
        """Forward-only pass through all stages (for validation), returning the output on the last stage.

        torch 2.13's `schedule.eval` fails for V-shaped schedules ("can't steal_bwd_input"), so evaluation walks
        the stages in order with plain send/recv: every rank visits the same global stage sequence, no deadlock.
        Hidden states travel in fp32.
        """
        pp = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        part_of = dict(zip(self.stage_ids, self.parts))
        h = None
        for s in range(self.n_stages):
            if stage_owner(s, pp, self.v_shape) != me:
                continue
            if s == 0:
                h = tokens
            elif stage_owner(s - 1, pp, self.v_shape) != me:
                h = torch.empty(hidden_shape, dtype=torch.float32, device=tokens.device)
                dist.recv(h, group_src=stage_owner(s - 1, pp, self.v_shape), group=self.group)
            h = part_of[s](h)
            if s == self.n_stages - 1:
                return h
            if stage_owner(s + 1, pp, self.v_shape) != me:
                dist.send(h.float().contiguous(), group_dst=stage_owner(s + 1, pp, self.v_shape), group=self.group)
        return None


@dataclass(frozen=True)
class StagePlan:
    """Which units each stage holds and which stages this pipeline rank runs."""

    names: list[list[str]]
    stage_ids: list[int]
    v_shape: bool

    @property
    def n_stages(self) -> int:
        return len(self.names)


def plan_stages(n_layers: int, pp: int, pp_rank: int, par_cfg) -> StagePlan:
    """Stage split from `[parallelism]`: explicit module lists per stage, or balanced by layer count."""
    schedule_name = par_cfg.pipeline_parallel_schedule
    if par_cfg.pipeline_parallel_module_fqns_per_stage:
        names = [entry.split() for entry in par_cfg.pipeline_parallel_module_fqns_per_stage]
    else:
        n_stages = pp * stages_per_rank(schedule_name, n_layers, pp, par_cfg.pipeline_parallel_layers_per_stage)
        names = split_module_names(n_layers, n_stages)
    v_shape = schedule_name in V_SHAPED
    return StagePlan(names, stage_ids_of_rank(pp_rank, pp, len(names), v_shape), v_shape)


def build_pipeline(model: nn.Module, parallel_dims, meshes, par_cfg, n_microbatches: int,
                   loss_fn: Callable, parallelize: Callable[[nn.Module], nn.Module], device: torch.device) -> Pipeline:
    """Split `model`, parallelize and wrap this rank's stages, and build the schedule.

    `parallelize(part)` applies EP/AC/compile/FSDP to one stage; it runs before materialisation, like for a model
    without pipeline parallelism.
    """
    schedule_name = par_cfg.pipeline_parallel_schedule
    plan = plan_stages(len(model.layers), parallel_dims.pp, meshes.pp.get_local_rank(), par_cfg)
    parts, stages = [], []
    for stage_id in plan.stage_ids:
        part = parallelize(extract_stage(model, plan.names[stage_id]))
        parts.append(part)
        stages.append(PipelineStage(part, stage_id, plan.n_stages, device, group=meshes.group("pp")))
    if schedule_name in SINGLE_STAGE:
        schedule = SINGLE_STAGE[schedule_name](stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn,
                                               scale_grads=False)
    else:
        cls = {**LOOPED, **V_SHAPED}[schedule_name]
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(schedule, parts, plan.stage_ids, plan.n_stages, plan.v_shape, meshes.group("pp"))
