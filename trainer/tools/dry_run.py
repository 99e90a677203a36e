"""Dry run: check a parallel layout for any world size in one CPU process, without GPUs.

`python -m trainer.dry_run --ngpu 16 --job.config_file train_configs/deepseek_v3_16b.toml [overrides]` (without
a config the trainer's default, `train_configs/debug_model.toml`), or `./run_train.sh --parallelism.dry_run true`
with NGPU set, validates the degrees, then, for one rank per pipeline stage, joins a fake process group as that
rank, builds the real meshes and the rank's model parts on the meta device through the trainer's own build path
(`trainer.build`: pipeline split, expert parallelism, FP8, AC, compile, FSDP; no memory), and prints what that rank
would hold: parameters (fp32 master weights), gradients and AdamW state in bytes, how many blocks are
checkpointed, plus each distinct sharding of its parameters (mesh dimensions and placements) with how many
parameters have it and the first of them with its local shape.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from core.config import ConfigError, run_with_config_errors
from parallelisms.mesh import build_meshes
from trainer.build import build_model_parts
from trainer.job_config import load_command_config, model_job, validate_job
from trainer.optimizer import STATE_DTYPES
from trainer.registry import get_model_spec


def _local_numel(p: torch.Tensor) -> int:
    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def _shardings(named: list[tuple[str, torch.Tensor]]) -> list[dict]:
    """One entry per distinct sharding (mesh dimensions and placements) in parameter order: the sharding, how many
    parameters have it, and the first of them with its local shape."""
    found: dict[str, dict] = {}
    for name, p in named:
        key = f"{tuple(p.device_mesh.mesh_dim_names)} {p.placements}" if isinstance(p, DTensor) else "plain"
        entry = found.setdefault(key, {"sharding": key, "params": 0, "example": name,
                                       "local_shape": list((p.to_local() if isinstance(p, DTensor) else p).shape)})
        entry["params"] += 1
    return list(found.values())


def inspect_rank(cfg, world_size: int, rank: int) -> dict:
    """Join a fake process group as `rank`, build its model part(s) on meta, and return its plan."""
    # torch's internal testing package: loaded only when a dry run happens
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = validate_job(cfg, world_size)
    spec = get_model_spec(cfg.model.name)
    args = spec.build_args(model_job(cfg))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        meshes = build_meshes(dims, "cpu")
        built = build_model_parts(spec, args, cfg, dims, meshes)
        parts = built.parts
        stages = ["all"] if built.stage_plan is None else [" ".join(compact(names)) for names in built.stage_names()]
        # parameters under their state_dict keys: the names checkpoints use, without the wrappers' prefixes
        named = [(k, t) for part in parts for k, t in part.state_dict(keep_vars=True).items()
                 if isinstance(t, torch.nn.Parameter)]
        numel = sum(_local_numel(p) for _, p in named)
        checkpointed = sum(isinstance(m, CheckpointWrapper) for part in parts for m in part.modules())
        coords = dict(zip(meshes.world.mesh_dim_names, meshes.world.get_coordinate()))
        if dims.cp_enabled:
            # the same ranks read as (pp, dp_replicate, dp_shard, cp): which share of each sequence it holds
            coords.update(dp_shard=(rank // dims.cp) % dims.dp_shard, cp=meshes.cp.get_local_rank())
        return {
            "rank": rank,
            "coords": coords,
            "stages": stages,
            "params": numel,
            "param_bytes": 4 * numel,
            "grad_bytes": 4 * numel,
            "optimizer_bytes": 2 * STATE_DTYPES[cfg.optimizer.state_dtype].itemsize * numel,
            "total_bytes": (8 + 2 * STATE_DTYPES[cfg.optimizer.state_dtype].itemsize) * numel,
            "shardings": _shardings(named),
            # the wrappers apply_ac built: the dry run shows AC as the run would apply it, not only as configured
            "checkpointed_blocks": checkpointed,
        }
    finally:
        dist.destroy_process_group()


def compact(names: list[str]) -> list[str]:
    """Numbered names of one prefix as one range, where the first of them stands, for printing:
    `emb blocks.3 blocks.4 blocks.5 head` -> `emb blocks.3-5 head`."""
    out: list[list[str]] = []  # [name] or [prefix, first index, last index]
    ranges: dict[str, list[str]] = {}
    for name in names:
        prefix, _, index = name.rpartition(".")
        if not (prefix and index.isdigit()):
            out.append([name])
        elif prefix in ranges:
            ranges[prefix][2] = index
        else:
            ranges[prefix] = [prefix, index, index]
            out.append(ranges[prefix])
    return [entry[0] if len(entry) == 1 else f"{entry[0]}.{entry[1]}-{entry[2]}" for entry in out]


def report(cfg, world_size: int) -> list[dict]:
    """The plan of the first rank of every pipeline stage (ranks of one stage hold equal shares)."""
    dims = validate_job(cfg, world_size)
    per_stage = world_size // dims.pp
    return [inspect_rank(cfg, world_size, p * per_stage) for p in range(dims.pp)]


def print_report(rows: list[dict], world_size: int, cfg) -> None:
    """Human-readable table of `report`."""
    gib = 2 ** 30
    cp = cfg.parallelism.context_parallel_degree
    layout = "pp x dp_replicate x efsdp x ep, pp outermost" + (
        f"; efsdp x ep = dp_shard x cp with cp {cp} innermost" if cp > 1 else "")
    print(f"dry run: {cfg.model.name}/{cfg.model.flavor} on {world_size} ranks ({layout})")
    for r in rows:
        print(f"rank {r['rank']:>5} {r['coords']}  stages: {'; '.join(r['stages'])}")
        print(f"    params {r['params'] / 1e9:.3f}B: weights {r['param_bytes'] / gib:.2f} GiB + grads "
              f"{r['grad_bytes'] / gib:.2f} GiB + AdamW {r['optimizer_bytes'] / gib:.2f} GiB = "
              f"{r['total_bytes'] / gib:.2f} GiB (fp32 weights, {cfg.optimizer.state_dtype} AdamW moments; before "
              "activations)")
        print(f"    activation checkpointing {cfg.activation_checkpoint.mode}: {r['checkpointed_blocks']} blocks "
              "checkpointed")
        for entry in r["shardings"]:
            print(f"    {entry['sharding']}: {entry['params']} parameters, e.g. {entry['example']} local "
                  f"{tuple(entry['local_shape'])}")


def main(argv: list[str]) -> None:
    """`python -m trainer.dry_run --ngpu N [--json] [config args]` (without a config the trainer's default)."""
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    if argv[:1] != ["--ngpu"] or len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
        raise ConfigError("--ngpu", "must come first, with a whole number of ranks >= 1",
                          "python -m trainer.dry_run --ngpu N [--json] [config args]")
    world_size, cfg = int(argv[1]), load_command_config(argv[2:])
    rows = report(cfg, world_size)
    if as_json:
        print(json.dumps({"world_size": world_size, "ranks": rows}))
    else:
        print_report(rows, world_size, cfg)


def cli() -> None:
    """The command line: `main` with config errors as one line and exit code 2."""
    run_with_config_errors(main, sys.argv[1:])
