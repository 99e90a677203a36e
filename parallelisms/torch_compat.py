"""Which torch this is, asked in one place.

The trainer supports torch 2.11 and later (pyproject's floor; development pins 2.13.0). Code that uses an API newer
than the floor asks `torch_at_least` here and takes an equivalent older path or says in one line what it gives up,
instead of failing with a TypeError deep inside torch. The features and their minimum versions are listed in
docs/torch_versions.md.
"""

from __future__ import annotations

import re

import torch

__all__ = ["MIN_TORCH", "torch_at_least", "torch_version"]

MIN_TORCH = (2, 11)
"""Oldest (major, minor) the trainer supports."""


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch, read from `torch.__version__` ("2.13.0+cpu", "2.12.0a0+git1234")."""
    match = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if match is None:
        raise RuntimeError(f"cannot read torch's version from {torch.__version__!r}")
    return int(match.group(1)), int(match.group(2))


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the running torch is version major.minor or newer (pre-releases of major.minor count as it)."""
    return torch_version() >= (major, minor)
