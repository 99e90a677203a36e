"""The checkpoints on disk: which `step-<N>` folders are complete, which are damaged (checked against their DCP
metadata, without loading them, or against the checksums written at save), and the ones a run resumes from."""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from collections.abc import Iterator

import torch.distributed.checkpoint as dcp

logger = logging.getLogger("trainer")

_STEP_DIR = re.compile(r"^step-(\d+)$")
_STEP_OR_TMP_DIR = re.compile(r"^step-(\d+)(\.tmp)?$")  # a published checkpoint, or a save still being written


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, corrupt, from another model); one-line message."""


CHECKSUMS = "checksums"
"""Folder in a checkpoint saved with `verify = "checksum"`: `rank_<r>.json` per saving rank, {file: [bytes, CRC32]}
of the files that rank wrote."""

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


def checkpoint_damage(path: str, verify: str = "size") -> str | None:
    """Why the checkpoint at `path` cannot be read (missing, unreadable metadata, with `verify` "size" or "checksum"
    a shard missing or cut short), or None; reads the metadata and file sizes only."""
    if not os.path.isdir(path):
        return f"checkpoint {path} does not exist"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        return f"checkpoint {path} is unreadable or incomplete ({type(e).__name__})"
    if verify == "off":
        return None
    for item in metadata.storage_data.values():
        file = os.path.join(path, item.relative_path)
        if not os.path.isfile(file) or os.path.getsize(file) < item.offset + item.length:
            return f"checkpoint {path} is truncated: {item.relative_path} is missing or too short"
    return None


def _crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_checksums(folder: str, rank: int) -> None:
    """Record the size and CRC32 of the files `rank` wrote into the checkpoint being saved at `folder` (DCP names
    them `__<rank>_<i>.distcp`) in `CHECKSUMS/rank_<rank>.json`."""
    files = sorted(name for name in os.listdir(folder) if name.startswith(f"__{rank}_") and name.endswith(".distcp"))
    entries = {name: [os.path.getsize(os.path.join(folder, name)), _crc32(os.path.join(folder, name))]
               for name in files}
    os.makedirs(os.path.join(folder, CHECKSUMS), exist_ok=True)
    with open(os.path.join(folder, CHECKSUMS, f"rank_{rank}.json"), "w") as f:
        json.dump(entries, f)


def checksum_damage(path: str, rank: int, world_size: int) -> str | None:
    """The first file of the checkpoint at `path` whose size or CRC32 differs from what its saving rank recorded,
    among the files this rank checks (those saving rank w wrote are checked by rank w % world_size: its own when
    the layout is the one that saved); None if all match or the checkpoint holds no checksums."""
    folder = os.path.join(path, CHECKSUMS)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        match = re.fullmatch(r"rank_(\d+)\.json", name)
        if match is None or int(match.group(1)) % world_size != rank:
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                entries = json.load(f)
        except (OSError, ValueError) as e:
            return f"its checksums {CHECKSUMS}/{name} are unreadable ({type(e).__name__})"
        for file, (size, crc) in entries.items():
            full = os.path.join(path, file)
            if not os.path.isfile(full) or os.path.getsize(full) != size:
                return f"{file} is missing or not the size it was saved with"
            if _crc32(full) != crc:
                return f"{file} does not match its checksum (changed since it was saved)"
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


def resume_candidates(cfg, dump_folder: str, skipped: list[tuple[int, str]]) -> Iterator[str]:
    """The checkpoints a run with `[checkpoint]` section `cfg` would resume from, in the order it tries them; each
    folder passed over is added to `skipped` as (step, `name (why)`) on the way.

    With `load_step = -1` every intact checkpoint, newest first (a resume falls back to the next one when a load
    fails): folders that are incomplete (no DCP `.metadata`, or a `.tmp` save) or damaged (unreadable metadata, a
    shard missing or cut short, as `cfg.verify` checks: a full disk, a failing node) are skipped, so an unattended
    restart never stops on them. When every checkpoint is damaged, CheckpointError: starting over would silently
    discard the run. A `load_step` is the one candidate, taken as it is (a damaged one is then refused by
    `check_checkpoint`). With `enable = false` only a checkpoint saved on a preemption signal counts
    (trainer/preemption.py): the same command continues after a requeue.
    """
    folder = os.path.join(dump_folder, cfg.folder)
    steps = list_checkpoints(folder)
    if not cfg.enable:
        steps = [step for step in steps if os.path.isfile(os.path.join(folder, f"step-{step}", PREEMPTED_MARKER))]
    if cfg.load_step != -1:
        if cfg.load_step not in steps:
            raise CheckpointError(f"checkpoint.load_step {cfg.load_step} not found in {folder} (have {steps})")
        yield os.path.join(folder, f"step-{cfg.load_step}")
        return
    if cfg.enable:
        skipped += [(step, f"{name} ({why})") for step, name, why in _incomplete_checkpoints(folder)]
    intact, newest_damage = False, None
    for step in reversed(steps):
        path = os.path.join(folder, f"step-{step}")
        damage = checkpoint_damage(path, cfg.verify)
        if damage is None:
            intact = True
            yield path
            continue
        newest_damage = newest_damage or damage
        skipped.append((step, f"step-{step} ({damage.removeprefix(f'checkpoint {path} ')})"))
    if not intact and newest_damage is not None:
        # every checkpoint is damaged: starting over would silently throw the run's progress away
        raise CheckpointError(f"{newest_damage}, and no older checkpoint in {folder} is intact")


def skipped_line(skipped: list[tuple[int, str]], folder: str, chosen: str | None) -> str | None:
    """The one warning naming the checkpoints newer than `chosen` that a resume skipped, and where it resumes."""
    step = int(os.path.basename(chosen).removeprefix("step-")) if chosen is not None else None
    newer = [what for s, what in sorted(skipped) if step is None or s > step]
    if not newer:
        return None
    where = f"resuming from {os.path.basename(chosen)}" if chosen else "no intact checkpoint to resume from"
    return f"checkpoint: skipped {', '.join(newer)} in {folder}; {where}"


def latest_checkpoint(cfg, dump_folder: str, report_skipped: bool = False) -> str | None:
    """Path of the checkpoint a run with `[checkpoint]` section `cfg` would resume from, if any: the first of
    `resume_candidates`. With `report_skipped` a warning names the newer folders it skips (pass it in one process
    of a run only: preflight and the other ranks run the same search)."""
    skipped: list[tuple[int, str]] = []
    chosen = next(resume_candidates(cfg, dump_folder, skipped), None)
    line = skipped_line(skipped, os.path.join(dump_folder, cfg.folder), chosen)
    if line is not None and report_skipped:
        logger.warning(line)
    return chosen
