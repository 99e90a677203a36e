"""Pipeline parallelism: split the model into stages by units and run them with a `torch.distributed.pipelining`
schedule.

Split: the model spec names the units in forward order (`SplitUnits`: a first unit that takes the tokens, e.g.
the embedding; the repeated blocks; a last unit that makes the output, e.g. the final norm and the head); the first
and the last unit each count as one layer when balancing stages.
The spec's `pipeline.stage(model, names)` makes each stage: a copy of the (meta-device) model that keeps only the
named modules, with the parameter names of the full model. Stage s of S runs on pipeline rank s % pp for looped
schedules, and on rank s or 2*pp-1-s for V-shaped ones (ZBVZeroBubble, DualPipeV).

The loss runs on the last stage only; schedules call it per microbatch, and the trainer hands over a loss already
divided by the global number of tokens (`core.loss.ScaledLoss`), so gradients do not need the schedule's own
scaling (`scale_grads=False`).
"""

from __future__ import annotations

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

from parallelisms.torch_compat import torch_at_least

SINGLE_STAGE = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
LOOPED = {"Interleaved1F1B": ScheduleInterleaved1F1B}
V_SHAPED = {"ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}


@dataclass(frozen=True)
class SplitUnits:
    """A model's pipeline split units in forward order, each a tuple of module names that stay on one stage.

    first: the unit the first stage holds (it takes the tokens, e.g. the embedding); layers: the repeated blocks;
    last: the unit the last stage holds (it makes the output, e.g. the final norm and the head).
    """

    first: tuple[str, ...]
    layers: tuple[tuple[str, ...], ...]
    last: tuple[str, ...]

    def ordered(self) -> list[tuple[str, ...]]:
        """Every unit, first to last."""
        return [self.first, *self.layers, self.last]


def schedule_problem(schedule: str, device_type: str) -> tuple[str, str, str] | None:
    """Why `schedule` cannot run on `device_type` ("cpu" or "cuda") with this torch, as a ConfigError's (key,
    problem, allowed values), or None.

    A V-shaped schedule puts stages pp - 1 and pp, neighbours, on one rank. Before its first step, torch 2.11's
    schedule sends a tensor from every stage to each neighbour, the other stage of the same rank included; gloo, the
    CPU backend, has no connection from a rank to itself, and the step fails inside torch ("Pair is not
    connected"). torch 2.13 sets up its stages without that send (2.12 not checked, so treated as 2.11). GPUs run
    NCCL, which is not refused here: the failure was seen with gloo only.
    """
    if schedule in V_SHAPED and device_type == "cpu" and not torch_at_least(2, 13):
        return ("parallelism.pipeline_parallel_schedule",
                f"{schedule} on CPU (gloo) needs torch 2.13 or later: torch {torch.__version__}'s pipeline sends "
                "between the two stages of one rank before the first step, which gloo cannot do",
                f"{', '.join([*SINGLE_STAGE, *LOOPED])} (or {schedule} with torch >= 2.13)")
    return None


def stages_per_rank(schedule: str, n_units: int, pp: int, layers_per_stage: int) -> int:
    """1 for single-stage schedules, 2 for V-shaped ones; looped schedules derive it from layers_per_stage."""
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    if layers_per_stage > 0:
        return max(1, -(-n_units // (layers_per_stage * pp)))
    return 2


def split_module_names(units: SplitUnits, n_stages: int) -> list[list[str]]:
    """Module names per stage, balanced by units (the first and the last unit count as one layer each)."""
    ordered = units.ordered()
    if n_stages > len(ordered):
        raise ValueError(f"{n_stages} pipeline stages for only {len(ordered)} units (embedding, layers, head)")
    base, extra = divmod(len(ordered), n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append([name for unit in ordered[start:start + size] for name in unit])
        start += size
    return out


def stage_ids_of_rank(pp_rank: int, pp: int, n_stages: int, v_shape: bool) -> list[int]:
    """Global stage indices this pipeline rank runs."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp))


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


def plan_stages(units: SplitUnits, pp: int, pp_rank: int, par_cfg) -> StagePlan:
    """Stage split from `[parallelism]`: explicit module lists per stage, or balanced by unit count."""
    schedule_name = par_cfg.pipeline_parallel_schedule
    if par_cfg.pipeline_parallel_module_fqns_per_stage:
        names = [entry.split() for entry in par_cfg.pipeline_parallel_module_fqns_per_stage]
    else:
        n_units = len(units.ordered())
        n_stages = pp * stages_per_rank(schedule_name, n_units, pp, par_cfg.pipeline_parallel_layers_per_stage)
        names = split_module_names(units, n_stages)
    v_shape = schedule_name in V_SHAPED
    return StagePlan(names, stage_ids_of_rank(pp_rank, pp, len(names), v_shape), v_shape)


def build_schedule(parts: list[nn.Module], plan: StagePlan, parallel_dims, meshes, par_cfg, n_microbatches: int,
                   loss_fn: Callable, device: torch.device) -> Pipeline:
    """Wrap this rank's stage modules `parts` (already split by `plan` and parallelized, possibly still on the meta
    device) in pipeline stages and build the schedule of `par_cfg`."""
    schedule_name = par_cfg.pipeline_parallel_schedule
    stages = [PipelineStage(part, stage_id, plan.n_stages, device, group=meshes.group("pp"))
              for part, stage_id in zip(parts, plan.stage_ids)]
    if schedule_name in SINGLE_STAGE:
        schedule = SINGLE_STAGE[schedule_name](stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn,
                                               scale_grads=False)
    else:
        cls = {**LOOPED, **V_SHAPED}[schedule_name]
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(schedule, list(parts), plan.stage_ids, plan.n_stages, plan.v_shape, meshes.group("pp"))
