"""FSDP2 (`fully_shard`) for a DeepSeek-V3 model part: per block, experts on their own mesh, root last.

Gradients are summed, never averaged: the loss is already divided by the global number of tokens, so FSDP's
division by the data-parallel size would scale gradients down a second time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def apply_fsdp(model: nn.Module, meshes, param_dtype: str, reduce_dtype: str, reshard_after_forward: bool) -> None:
    """Shard `model` in place. Embedding, each block, the MTP blocks and [norm, output] are separate units."""
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    dense = dict(mesh=meshes.dense, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **dense)
    blocks = list(model.layers.values())
    if model.mtp is not None:
        blocks += [mod.block for mod in model.mtp.layers]
    for block in blocks:
        if meshes.experts is not None and block.moe_enabled:
            # experts are already split over EP; FSDP shards each rank's experts over the remaining DP ranks
            fully_shard(block.moe.experts, mesh=meshes.experts, mp_policy=mp,
                        reshard_after_forward=reshard_after_forward)
        fully_shard(block, **dense)
    head = [m for m in (model.norm, model.output) if m is not None]
    if head:
        # the head runs last in forward and first in backward: resharding it in between only adds an all-gather
        fully_shard(head, **{**dense, "reshard_after_forward": False})
    fully_shard(model, **dense)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    if meshes.ep is not None:
        _set_explicit_prefetch(model, blocks)


def _set_explicit_prefetch(model: nn.Module, blocks: list[nn.Module]) -> None:
    """With EP, every MoE layer syncs with the host (split sizes), which stalls FSDP's implicit prefetch of the
    next block's all-gather; name the next units explicitly so their all-gathers are issued early."""
    units = ([model.tok_embeddings] if model.tok_embeddings is not None else []) + blocks
    for current, following in zip(units, units[1:]):
        nxt = [following]
        if getattr(following, "moe_enabled", False) and isinstance(following.moe.experts, FSDPModule):
            nxt.append(following.moe.experts)
        current.set_modules_to_forward_prefetch(nxt)
    reversed_blocks = blocks[::-1]
    for current, previous in zip(reversed_blocks, reversed_blocks[1:]):
        prev = [previous]
        if getattr(previous, "moe_enabled", False) and isinstance(previous.moe.experts, FSDPModule):
            prev.append(previous.moe.experts)
        current.set_modules_to_backward_prefetch(prev)
