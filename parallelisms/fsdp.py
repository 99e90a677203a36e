"""FSDP2 (`fully_shard`) over the units a model's parallelize plan hands in, root last.

The plan names the units (which modules form one all-gather, on which mesh, with which reshard choice) and, where
implicit prefetch would stall, the order in which units run; this module knows no model.

Gradients are summed, never averaged: the loss is already divided by the global number of tokens, so FSDP's
division by the data-parallel size would scale gradients down a second time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["FSDPUnit", "apply_fsdp"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class FSDPUnit:
    """One `fully_shard` call: its parameters are all-gathered together.

    modules: a module, or a list of modules sharded as one group.
    mesh: the `Meshes` field to shard over: "dense" (non-expert weights) or "experts" (expert weights, already
        split over EP; FSDP shards each rank's share over the remaining data-parallel ranks).
    reshard_after_forward: None follows the job's setting; True or False overrides it for this unit.
    """

    modules: nn.Module | list[nn.Module]
    mesh: str = "dense"
    reshard_after_forward: bool | None = None


def apply_fsdp(units: Sequence[FSDPUnit], root: nn.Module, meshes, param_dtype: str, reduce_dtype: str,
               reshard_after_forward: bool, forward_prefetch: Sequence[Sequence[nn.Module]] = (),
               backward_prefetch: Sequence[Sequence[nn.Module]] = ()) -> None:
    """Shard `units` in the given order (a unit nested in another comes first), then `root` on the dense mesh.

    forward_prefetch / backward_prefetch: groups of modules in forward order. When a group's first module runs
    (forward, resp. backward), it issues the all-gathers of the sharded modules of the group that runs next
    (the following group in forward, the preceding one in backward). Empty: FSDP's implicit prefetch.
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    for unit in units:
        reshard = reshard_after_forward if unit.reshard_after_forward is None else unit.reshard_after_forward
        fully_shard(unit.modules, mesh=getattr(meshes, unit.mesh), mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(root, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    for current, following in zip(forward_prefetch, forward_prefetch[1:]):
        current[0].set_modules_to_forward_prefetch(_sharded(following))
    reversed_groups = list(backward_prefetch)[::-1]
    for current, previous in zip(reversed_groups, reversed_groups[1:]):
        current[0].set_modules_to_backward_prefetch(_sharded(previous))


def _sharded(group: Sequence[nn.Module]) -> list[FSDPModule]:
    return [m for m in group if isinstance(m, FSDPModule)]
