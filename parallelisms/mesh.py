"""Device meshes from the parallel degrees.

The world is one mesh `(pp, dp_replicate, efsdp, ep)`, pp outermost. The ranks of `(efsdp, ep)` are the shard
span, `dp_shard * cp` of them: read the other way they are `(dp_shard, cp)` with cp innermost, so a rank's
data-parallel index is `(rank // cp) % dp` and its context-parallel index `rank % cp` (the data loader relies on
this). Expert parallelism borrows ranks from the shard span: `dp_shard * cp = efsdp * ep`. From that one mesh:

    dense    FSDP mesh of non-expert weights: (dp_replicate, dp_shard) for HSDP, else (dp_shard,); with cp > 1
             the shard dimension is dp_shard * cp ranks, named dp_shard_cp
    experts  FSDP mesh of expert weights:    (dp_replicate, efsdp) for HSDP, else (efsdp,)
    ep       the ranks that split the routed experts between them (all-to-all group)
    dp       every rank of a stage holding other tokens (dp * cp), flattened: global token counts, loss,
             expert-load counts
    cp       the ranks that split each sequence (a mesh of its own over the same ranks, see `build_meshes`)
    pp       the pipeline stages

The meshes are built once per layout and default process group, and reused by every later trainer of that layout in
the process (tests and sweeps run several jobs in one launch): torch keeps a gloo group alive after
`destroy_process_group` once a functional collective ran on it (docs/torch_versions.md), so a mesh per job leaked
3 threads and 5 file descriptors per group, and a job at the end of a 54-job test launch ran up to 3.7x slower than
at its start.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class Meshes:
    """Sub-meshes of the world mesh; a field is None when its degree is 1 (nothing to communicate)."""

    world: DeviceMesh
    dense: DeviceMesh | None
    experts: DeviceMesh | None
    ep: DeviceMesh | None
    dp: DeviceMesh | None
    pp: DeviceMesh | None
    cp: DeviceMesh | None = None

    def group(self, name: str):
        """Process group of a 1-D sub-mesh ("ep", "dp", "pp", "cp"), or None when that dimension is trivial."""
        mesh = getattr(self, name)
        return None if mesh is None else mesh.get_group()


#: the meshes built on the default process group `_built_on`, by (dims, device type)
_built: dict[tuple, Meshes] = {}
_built_on: dist.ProcessGroup | None = None


def build_meshes(dims, device_type: str) -> Meshes:
    """The meshes of `dims` (a ParallelDims) on the default process group: the ones built before for this layout,
    or a new world mesh and its slices (see the module's docstring)."""
    global _built_on
    if _built_on is not dist.group.WORLD:  # a new default group: the old groups are gone with the old one
        _built.clear()
        _built_on = dist.group.WORLD
    key = (dims, device_type)
    if key not in _built:
        _built[key] = _new_meshes(dims, device_type)
    return _built[key]


def _new_meshes(dims, device_type: str) -> Meshes:
    world = init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.efsdp, dims.ep),
                             mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    # the shard span: named dp_shard_cp when context-parallel ranks are part of it (as in torchtitan)
    span = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    dp_shard = world["efsdp", "ep"]._flatten(span)
    dp = world["dp_replicate", "efsdp", "ep"]._flatten("dp")
    cp = None
    if dims.cp > 1:
        # cp is the innermost factor of the world, but ep need not be a multiple of it (nor it of ep): no slice of
        # the world mesh gives it, a second mesh over the same ranks, (the rest, cp), does
        cp = DeviceMesh(device_type, world.mesh.reshape(-1, dims.cp), mesh_dim_names=("cp_rest", "cp"))["cp"]
    dense = experts = None
    if dims.token_ranks > 1:
        dense = dp_shard
        experts = world["efsdp"] if dims.ep > 1 else None
        if dims.dp_replicate > 1:
            with warnings.catch_warnings():
                # HSDP needs the 2-D (replicate, shard) mesh, which only slicing the root mesh can give in 2.13
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                dense = world["dp_replicate", span]
            experts = world["dp_replicate", "efsdp"] if dims.ep > 1 else None
    return Meshes(
        world=world,
        dense=dense,
        experts=experts,
        ep=world["ep"] if dims.ep > 1 else None,
        dp=dp if dims.token_ranks > 1 else None,
        pp=world["pp"] if dims.pp > 1 else None,
        cp=cp,
    )
