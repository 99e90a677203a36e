"""Device meshes from the parallel degrees.

The world is one mesh `(pp, dp_replicate, efsdp, ep)`, pp outermost, so a rank's data-parallel index is
`rank % dp` (the data loader relies on this). Expert parallelism borrows ranks from the data-parallel shard
dimension: `dp_shard = efsdp * ep`. From that one mesh:

    dense    FSDP mesh of non-expert weights: (dp_replicate, dp_shard) for HSDP, else (dp_shard,)
    experts  FSDP mesh of expert weights:    (dp_replicate, efsdp) for HSDP, else (efsdp,)
    ep       the ranks that split the routed experts between them (all-to-all group)
    dp       every data-parallel rank, flattened (global token counts, loss, expert-load counts)
    pp       the pipeline stages
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

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

    def group(self, name: str):
        """Process group of a 1-D sub-mesh ("ep", "dp", "pp"), or None when that dimension is trivial."""
        mesh = getattr(self, name)
        return None if mesh is None else mesh.get_group()


def build_meshes(dims, device_type: str) -> Meshes:
    """Create the world mesh for `dims` (a ParallelDims) on the default process group and slice it."""
    world = init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.efsdp, dims.ep),
                             mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    dp_shard = world["efsdp", "ep"]._flatten("dp_shard")
    dp = world["dp_replicate", "efsdp", "ep"]._flatten("dp")
    dense = experts = None
    if dims.dp > 1:
        dense = dp_shard
        experts = world["efsdp"] if dims.ep > 1 else None
        if dims.dp_replicate > 1:
            with warnings.catch_warnings():
                # HSDP needs the 2-D (replicate, shard) mesh, which only slicing the root mesh can give in 2.13
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                dense = world["dp_replicate", "dp_shard"]
            experts = world["dp_replicate", "efsdp"] if dims.ep > 1 else None
    return Meshes(
        world=world,
        dense=dense,
        experts=experts,
        ep=world["ep"] if dims.ep > 1 else None,
        dp=dp if dims.dp > 1 else None,
        pp=world["pp"] if dims.pp > 1 else None,
    )
