"""Layout-invariant parameter initialisation.

The same seed gives the same full weights whatever the parallel layout (one process, FSDP, HSDP, EP, pipeline
stages), so loss curves of different layouts can be compared from step 1. DTensor's own random ops cannot give
that on CPU (every rank draws its shard from the same generator state, so all shards come out identical).

Each parameter is cut along dim 0 into fixed blocks of rows; block b of parameter `fqn` is drawn from a generator
seeded by (seed, fqn, b). A rank generates only the blocks that hold its local rows (for sharded DTensors it finds
them by distributing a row index with the parameter's placements), so no rank ever materialises a full parameter.
The blocks are drawn on the host (the same values on every device) by a pool of threads: each block has its own
generator, so neither the order nor the number of threads changes a value.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

InitRule = Callable[[torch.Tensor, torch.Generator], None]
ROWS_PER_BLOCK = 64
#: host float32 staging of one group of parameters being initialised (`init_parameters_`)
STAGING_BYTES = 1 << 30


def _block_seed(seed: int, fqn: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{fqn}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _local_part(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's part of `param`: its local tensor, the global dim-0 indices of its rows, the global row count."""
    rows = torch.arange(param.shape[0])
    if not isinstance(param, DTensor):
        return param, rows, param.shape[0]
    if any(getattr(p, "dim", 0) != 0 for p in param.placements):
        raise NotImplementedError(f"layout-invariant init shards dim 0 only, got {param.placements}")
    # a [rows, 1, ...] index is enough: every placement shards dim 0 or replicates
    index = rows.view(-1, *([1] * (param.dim() - 1)))
    rows = distribute_tensor(index, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return param.to_local(), rows.reshape(-1), param.shape[0]


def _draw(rule: InitRule, out: torch.Tensor, seed: int, fqn: str, block: int) -> None:
    with torch.no_grad():  # grad mode is per thread: the caller's no_grad does not reach the pool's threads
        rule(out, torch.Generator().manual_seed(_block_seed(seed, fqn, block)))


def _fill_range(values: torch.Tensor, rule: InitRule, seed: int, fqn: str, block: int, first: int, last: int,
                rows: int) -> None:
    """Rows [first, last) of a parameter of `rows` rows live in `values`: the part of `block` among them."""
    start = block * ROWS_PER_BLOCK
    n = min(ROWS_PER_BLOCK, rows - start)
    lo, hi = max(start, first), min(start + n, last)
    if (lo, hi) == (start, start + n):  # the whole block is local: drawn in place
        _draw(rule, values.narrow(0, start - first, n), seed, fqn, block)
        return
    chunk = _drawn_block(values, rule, seed, fqn, block, rows)
    with torch.no_grad():
        values.narrow(0, lo - first, hi - lo).copy_(chunk.narrow(0, lo - start, hi - lo))


def _drawn_block(values: torch.Tensor, rule: InitRule, seed: int, fqn: str, block: int, rows: int) -> torch.Tensor:
    """Block `block` of a parameter of `rows` rows, drawn whole into a new tensor (rows of `values`' shape)."""
    chunk = torch.empty((min(ROWS_PER_BLOCK, rows - block * ROWS_PER_BLOCK), *values.shape[1:]), dtype=values.dtype)
    _draw(rule, chunk, seed, fqn, block)
    return chunk


def _fill_rows(values: torch.Tensor, rule: InitRule, seed: int, fqn: str, block: int, local_rows: torch.Tensor,
               rows: int) -> None:
    """The local rows (any global indices, `local_rows`) that fall in `block`."""
    start = block * ROWS_PER_BLOCK
    chunk = _drawn_block(values, rule, seed, fqn, block, rows)
    in_block = (local_rows // ROWS_PER_BLOCK) == block
    with torch.no_grad():
        values[in_block] = chunk[local_rows[in_block] - start]


def _stage(param: torch.Tensor, rule: InitRule, seed: int, fqn: str):
    """(device tensor, host float32 values, [(elements, job)]) for one parameter; None when it has no local rows.
    The values are the tensor itself where it is a contiguous float32 CPU tensor."""
    if param.dim() == 0:
        values = torch.empty((), dtype=torch.float32)
        return param, values, [(1, functools.partial(_draw, rule, values, seed, fqn, 0))]
    target, rows, total = _local_part(param)
    if rows.numel() == 0:
        return None
    in_place = target.device.type == "cpu" and target.dtype == torch.float32 and target.is_contiguous()
    values = target if in_place else torch.empty(target.shape, dtype=torch.float32)
    per_row = values[0].numel()
    first, count = int(rows[0]), rows.numel()
    if torch.equal(rows, torch.arange(first, first + count)):  # a plain tensor or a Shard(0) shard: a row range
        blocks = range(first // ROWS_PER_BLOCK, (first + count - 1) // ROWS_PER_BLOCK + 1)
        jobs = [(ROWS_PER_BLOCK * per_row, functools.partial(_fill_range, values, rule, seed, fqn, b, first,
                                                             first + count, total)) for b in blocks]
    else:
        jobs = [(ROWS_PER_BLOCK * per_row, functools.partial(_fill_rows, values, rule, seed, fqn, b, rows, total))
                for b in torch.unique(rows // ROWS_PER_BLOCK).tolist()]
    return target, values, jobs


def _run(staged: list, workers: int) -> None:
    """Draw every block of the staged parameters (largest first, `workers` threads: torch's ops release the GIL,
    and each block has its own generator, so the values do not depend on the order), then copy each to its device."""
    jobs = sorted((job for _, _, jobs in staged for job in jobs), key=lambda job: -job[0])
    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(min(workers, len(jobs))) as pool:
            list(pool.map(lambda job: job[1](), jobs))
    else:
        for _, job in jobs:
            job()
    for target, values, _ in staged:
        if values is not target:
            target.copy_(values)


@torch.no_grad()
def init_parameters_(items: Iterable[tuple[str, torch.Tensor, InitRule]], seed: int,
                     staging_bytes: int = STAGING_BYTES) -> None:
    """Fill each `(fqn, param, rule)` (plain or DTensor, any device) in place with its rows of the layout-invariant
    initialisation.

    The blocks are drawn on the host, in parallel threads (as many as torch's intra-op threads), a group of
    parameters at a time: a group holds at most `staging_bytes` of float32 staging (or one larger parameter), and
    the next parameter's staging exists beside it while it is drawn and copied to the parameters' device. The 2.57B
    parameters of the 671B-shape benchmark (train_configs/h100_bench_671b.toml) took 81 s on 2 CPU cores one block
    at a time, 40% of it in masked row copies that row-range shards no longer make, and take 34 s so."""
    workers = torch.get_num_threads()
    staged, staged_bytes = [], 0
    for fqn, param, rule in items:
        one = _stage(param, rule, seed, fqn)
        if one is None:
            continue
        size = 0 if one[1] is one[0] else one[1].numel() * 4
        if staged and staged_bytes + size > staging_bytes:
            _run(staged, workers)
            staged, staged_bytes = [], 0
        staged.append(one)
        staged_bytes += size
    if staged:
        _run(staged, workers)
