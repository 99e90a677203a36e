"""Layout-invariant parameter initialisation.

The same seed gives the same full weights whatever the parallel layout (one process, FSDP, HSDP, EP, pipeline
stages), so loss curves of different layouts can be compared from step 1. DTensor's own random ops cannot give
that on CPU (every rank draws its shard from the same generator state, so all shards come out identical).

Each parameter is cut along dim 0 into fixed blocks of rows; block b of parameter `fqn` is drawn from a generator
seeded by (seed, fqn, b). A rank generates only the blocks that hold its local rows (for sharded DTensors it finds
them by distributing a row index with the parameter's placements), so no rank ever materialises a full parameter.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

InitRule = Callable[[torch.Tensor, torch.Generator], None]
ROWS_PER_BLOCK = 64


def _block_seed(seed: int, fqn: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{fqn}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _local_rows(param: torch.Tensor) -> torch.Tensor:
    """Global dim-0 indices of the rows this rank holds (all rows for a plain tensor)."""
    rows = torch.arange(param.shape[0])
    if isinstance(param, DTensor):
        if any(getattr(p, "dim", 0) != 0 for p in param.placements):
            raise NotImplementedError(f"layout-invariant init shards dim 0 only, got {param.placements}")
        # a [rows, 1, ...] index is enough: every placement shards dim 0 or replicates
        index = rows.view(-1, *([1] * (param.dim() - 1)))
        rows = distribute_tensor(index, param.device_mesh, param.placements, src_data_rank=None).to_local()
        rows = rows.reshape(-1)
    return rows


@torch.no_grad()
def init_parameter_(param: torch.Tensor, rule: InitRule, seed: int, fqn: str) -> None:
    """Fill `param` (plain or DTensor, any device) in place with rows of the layout-invariant initialisation."""
    if param.dim() == 0:
        rule(param, torch.Generator().manual_seed(_block_seed(seed, fqn, 0)))
        return
    rows = _local_rows(param)
    target = param.to_local() if isinstance(param, DTensor) else param
    if rows.numel() == 0:
        return
    values = torch.empty(target.shape, dtype=torch.float32)
    for block in torch.unique(rows // ROWS_PER_BLOCK).tolist():
        start = block * ROWS_PER_BLOCK
        n = min(ROWS_PER_BLOCK, param.shape[0] - start)
        chunk = torch.empty((n, *param.shape[1:]), dtype=torch.float32)
        rule(chunk, torch.Generator().manual_seed(_block_seed(seed, fqn, block)))
        in_block = (rows // ROWS_PER_BLOCK) == block
        values[in_block] = chunk[rows[in_block] - start]
    target.copy_(values)
