"""Expert parallelism: split the routed experts over the EP ranks and route tokens with a dispatcher.

Each expert weight becomes a DTensor sharded on dim 0 (the expert dim) over the `ep` mesh, so rank r owns experts
[r * E/ep, (r+1) * E/ep). The MoE layer's dispatcher is swapped for the communicating backend registered under
the configured name (`parallelisms/moe_comm/registry.py`), whose `setup` hook then runs; the model code does not
change.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from core.token_dispatch import ExpertParallelLayer
from parallelisms.moe_comm.registry import get_comm_backend


def apply_expert_parallel(moe_layers: Iterable[ExpertParallelLayer], ep_mesh, backend: str, hidden_dim: int,
                          dtype: torch.dtype) -> None:
    """Shard the experts of every MoE layer over `ep_mesh` and install the `backend` dispatcher, set up for token
    rows of `hidden_dim` computed in `dtype` (comm buffers are created now, before any checkpointed forward)."""
    dispatcher_cls = get_comm_backend(backend)
    group = ep_mesh.get_group()
    for moe in moe_layers:
        experts = moe.experts
        params = list(experts.named_parameters(recurse=False))
        num_experts = params[0][1].shape[0]  # the expert dimension, before the split
        for name, param in params:
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        moe.dispatcher = dispatcher_cls(group, num_experts)
        moe.dispatcher.setup(hidden_dim, dtype)
