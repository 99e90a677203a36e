"""The checkpoints on disk: which `step-<N>` folders are complete, which are damaged (checked against their DCP
metadata, without loading them), and the one a run resumes from."""

from __future__ import annotations

import logging
import os
import re

import torch.distributed.checkpoint as dcp

logger = logging.getLogger("trainer")

_STEP_DIR = re.compile(r"^step-(\d+)$")
_STEP_OR_TMP_DIR = re.compile(r"^step-(\d+)(\.tmp)?$")  # a published checkpoint, or a save still being written


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, corrupt, from another model); one-line message."""


PREEMPTED_MARKER = "PREEMPTED"
"""File in a checkpoint saved on a preemption signal: a run with checkpoint.enable = false resumes from those."""


def list_checkpoints(folder: str) -> list[int]:
    """Steps of the complete checkpoints in `folder`, ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(match.group(1)))
    return sorted(steps)


def checkpoint_damage(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be read (missing, unreadable metadata, a shard missing or cut short), or
    None; reads the metadata and file sizes only."""
    if not os.path.isdir(path):
        return f"checkpoint {path} does not exist"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        return f"checkpoint {path} is unreadable or incomplete ({type(e).__name__})"
    for item in metadata.storage_data.values():
        file = os.path.join(path, item.relative_path)
        if not os.path.isfile(file) or os.path.getsize(file) < item.offset + item.length:
            return f"checkpoint {path} is truncated: {item.relative_path} is missing or too short"
    return None


def _incomplete_checkpoints(folder: str) -> list[tuple[int, str, str]]:
    """(step, folder name, why) of every `step-<N>` folder in `folder` that resume will not use."""
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = _STEP_OR_TMP_DIR.match(name)
        if match is None:
            continue
        if match.group(2):
            found.append((int(match.group(1)), name, "an unfinished save"))
        elif not os.path.isfile(os.path.join(folder, name, ".metadata")):
            found.append((int(match.group(1)), name, "no .metadata"))
    return sorted(found)


def latest_checkpoint(cfg, dump_folder: str, report_skipped: bool = False) -> str | None:
    """Path of the checkpoint a run with `[checkpoint]` section `cfg` would resume from, if any.

    With `load_step = -1` the newest intact checkpoint: folders that are incomplete (no DCP `.metadata`, or a `.tmp`
    save) or damaged (unreadable metadata, a shard missing or cut short: a full disk, a failing node) are skipped, so
    an unattended restart never stops on them; with `report_skipped` a warning names them (pass it in one process
    of a run only: preflight and the other ranks run the same search). When every checkpoint is damaged,
    CheckpointError: starting over would silently discard the run. A `load_step` is taken as it is (a damaged
    one is then refused by `check_checkpoint`). With `enable = false` only a checkpoint saved on a preemption
    signal counts (trainer/preemption.py): the same command continues after a requeue.
    """
    folder = os.path.join(dump_folder, cfg.folder)
    steps = list_checkpoints(folder)
    if not cfg.enable:
        steps = [step for step in steps if os.path.isfile(os.path.join(folder, f"step-{step}", PREEMPTED_MARKER))]
    if cfg.load_step != -1:
        if cfg.load_step not in steps:
            raise CheckpointError(f"checkpoint.load_step {cfg.load_step} not found in {folder} (have {steps})")
        return os.path.join(folder, f"step-{cfg.load_step}")
    skipped = [(step, f"{name} ({why})") for step, name, why in _incomplete_checkpoints(folder)] if cfg.enable else []
    chosen, newest_damage = None, None
    for step in reversed(steps):
        path = os.path.join(folder, f"step-{step}")
        damage = checkpoint_damage(path)
        if damage is None:
            chosen = step
            break
        newest_damage = newest_damage or damage
        skipped.append((step, f"step-{step} ({damage.removeprefix(f'checkpoint {path} ')})"))
    if chosen is None and newest_damage is not None:
        # every checkpoint is damaged: starting over would silently throw the run's progress away
        raise CheckpointError(f"{newest_damage}, and no older checkpoint in {folder} is intact")
    skipped = [what for step, what in sorted(skipped) if chosen is None or step > chosen]
    if skipped and report_skipped:
        logger.warning("checkpoint: skipped %s in %s; %s", ", ".join(skipped), folder,
                       f"resuming from step-{chosen}" if chosen is not None else "no intact checkpoint to resume from")
    return None if chosen is None else os.path.join(folder, f"step-{chosen}")
