"""Expert parallelism: split the routed experts over the EP ranks and route tokens with a dispatcher.

Each expert weight becomes a DTensor sharded on dim 0 (the expert dim) over the `ep` mesh, so rank r owns experts
[r * E/ep, (r+1) * E/ep). The MoE layer's dispatcher is swapped for a communicating backend; the model code does
not change.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from parallelisms.moe_comm.alltoall import AllToAllDispatcher


def apply_expert_parallel(moe_layers: list[nn.Module], ep_mesh, backend: str = "alltoall") -> None:
    """Shard the experts of every MoE layer over `ep_mesh` and install the `backend` dispatcher."""
    group = ep_mesh.get_group()
    for moe in moe_layers:
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        moe.dispatcher = _make_dispatcher(backend, group, experts.num_experts)


def _make_dispatcher(backend: str, group, num_experts: int):
    if backend == "alltoall":
        return AllToAllDispatcher(group, num_experts)
    if backend == "deepep":
        from parallelisms.moe_comm.deepep import DeepEPDispatcher

        return DeepEPDispatcher(group, num_experts)
    raise ValueError(f"unknown expert_parallel_comm_backend {backend!r}")
