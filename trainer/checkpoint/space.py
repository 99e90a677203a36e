"""Disk space for checkpoints: how many bytes a save writes, how many the checkpoint folder's file system has free,
and the words for a save that ran out of them (torch's zip writer reports a full disk as `unexpected pos 704 vs
598`, without an errno)."""

from __future__ import annotations

import errno
import os

import torch
from torch.distributed.checkpoint.stateful import Stateful

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def size_text(n: int) -> str:
    """`512 B`, `12.0 KiB`, `22.1 MiB`, `1.25 GiB`, `3.40 TiB`."""
    if n < 1024:
        return f"{n} B"
    for unit, scale in (("KiB", 2 ** 10), ("MiB", 2 ** 20), ("GiB", 2 ** 30), ("TiB", 2 ** 40)):
        if n < 1024 * scale or unit == "TiB":
            value = n / scale
            return f"{value:.1f} {unit}" if value < 100 or unit in ("KiB", "MiB") else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def state_bytes(states: dict) -> dict[str, int]:
    """{key: bytes} of what a DCP save of `states` holds, as this rank sees it: a tensor at its global size (a
    sharded DTensor counts whole, as every rank names it alike), a bytes object at its length. Calls the
    Statefuls' `state_dict()`; the union over the ranks' dicts is the checkpoint's size, less DCP's framing."""
    sizes: dict[str, int] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, Stateful):
            value = value.state_dict()
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)
        elif isinstance(value, torch.Tensor):  # a DTensor's numel is its global one
            sizes[prefix] = value.numel() * value.element_size()
        elif isinstance(value, (bytes, bytearray)):
            sizes[prefix] = len(value)

    walk("", states)
    return sizes


def free_bytes(folder: str) -> int:
    """Bytes free to this user on the file system that holds `folder` (or would: its nearest existing parent)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def folder_bytes(folder: str) -> int:
    """Bytes of the files under `folder` (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
    return total


def no_space_errno(error: BaseException) -> bool:
    """Whether `error` (or a rank's exception inside DCP's CheckpointException) is ENOSPC or EDQUOT."""
    failures = getattr(error, "failures", None)
    causes = [c[0] if isinstance(c, tuple) else c for c in failures.values()] if isinstance(failures, dict) else [
        error]
    return any(isinstance(c, OSError) and c.errno in _NO_SPACE for c in causes)


def full_disk_line(folder: str, free: int, needed: int) -> str:
    """The words for a save that does not fit: which folder, the bytes free and needed."""
    return f"the disk is full: {folder} has {size_text(free)} free, a checkpoint needs about {size_text(needed)}"
