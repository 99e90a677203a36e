"""The loop's step statistics, read to the host in one transfer on a step that logs.

A training step leaves its loss, gradient norm, non-finite flag and the model's statistics (MoE routing) on the
device as 0-d tensors. Reading each as it is produced (`.item()`, `float()`, `bool()`) makes the host wait for the
device every time, and the device then idles while the host launches the next step's first kernels (13-19 ms of a
95 ms step on an H200, docs/performance.md). `PendingSteps` keeps a step's values until a step that logs; `flush`
stacks every pending device value and reads them with one device-to-host copy (`read_to_host`), then hands back
each step's values as floats, in step order. A step that logs nothing reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PendingSteps", "StepRecord", "host_reads", "read_to_host"]

_reads = 0


def host_reads() -> int:
    """How many times `read_to_host` ran in this process (tests count the loop's device-to-host reads with it)."""
    return _reads


def read_to_host(values: list[torch.Tensor]) -> list[float]:
    """The values of 0-d (or one-element) tensors as floats, in one device-to-host copy: the one place the loop
    waits for the device."""
    global _reads
    if not values:
        return []
    _reads += 1
    # float64 holds every logged value exactly (int64 token counts up to 2^53, fp32 losses, bool flags)
    return torch.stack([v.detach().reshape(()).to(torch.float64) for v in values]).tolist()


@dataclass
class StepRecord:
    """One finished step: its scalars for the run folder (device values as tensors until flushed), this rank's own
    scalars, and what the throughput and the run summary need."""

    step: int
    scalars: dict[str, float | torch.Tensor]
    rank_scalars: dict[str, float] = field(default_factory=dict)
    local_tokens: int = 0
    global_tokens: int = 0


class PendingSteps:
    """Steps whose device values have not been read yet (see the module docstring)."""

    def __init__(self) -> None:
        self._records: list[StepRecord] = []

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: StepRecord) -> None:
        """Keep a finished step until the next `flush`."""
        self._records.append(record)

    def flush(self) -> list[StepRecord]:
        """Every pending step with its device values replaced by floats (one host read for all of them), oldest
        first; the pending list is then empty."""
        records, self._records = self._records, []
        slots = [(r.scalars, k) for r in records for k, v in r.scalars.items() if isinstance(v, torch.Tensor)]
        for (scalars, key), value in zip(slots, read_to_host([scalars[key] for scalars, key in slots])):
            scalars[key] = value
        return records
