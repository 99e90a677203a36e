"""The loop's step statistics, read to the host in one transfer on a step that logs.

A training step leaves its loss, gradient norm, non-finite flag and the model's statistics (MoE routing) on the
device as 0-d tensors. Reading each as it is produced (`.item()`, `float()`, `bool()`) makes the host wait for the
device every time, and the device then idles while the host launches the next step's first kernels (13-19 ms of a
95 ms step on an H200, docs/performance.md). `PendingSteps` keeps a step's values until a step that logs; `flush`
stacks every pending device value and reads them with one device-to-host copy (`read_to_host`), then hands back
each step's values as floats, in step order. A step that logs nothing reads nothing. A step's 1-D values (the tokens
each expert received, drawn as an image) are read only for the last pending step, and only when asked for: they
join the same transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PendingSteps", "StepRecord", "host_reads", "is_array", "read_to_host"]

_reads = 0


def host_reads() -> int:
    """How many times `read_to_host` ran in this process (tests count the loop's device-to-host reads with it)."""
    return _reads


def read_to_host(values: list[torch.Tensor]) -> list[float | list[float]]:
    """The values of tensors in one device-to-host copy, the one place the loop waits for the device: a 0-d (or
    one-element) tensor as a float, a 1-D one as a list of floats."""
    global _reads
    if not values:
        return []
    _reads += 1
    # float64 holds every logged value exactly (int64 token counts up to 2^53, fp32 losses, bool flags)
    flat = torch.cat([v.detach().reshape(-1).to(torch.float64) for v in values]).tolist()
    out, start = [], 0
    for v in values:
        n = v.numel()
        out.append(flat[start] if n == 1 else flat[start:start + n])
        start += n
    return out


def is_array(value) -> bool:
    """A step value that is a row of numbers (a 1-D tensor of several), not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() > 1


@dataclass
class StepRecord:
    """One finished step: its scalars for the run folder (device values as tensors until flushed), this rank's own
    scalars, and what the throughput and the run summary need."""

    step: int
    scalars: dict[str, float | torch.Tensor]
    rank_scalars: dict[str, float] = field(default_factory=dict)
    local_tokens: int = 0
    global_tokens: int = 0
    data_s: float = 0.0  # this rank's host seconds reading the step's batch (`Trainer.train_step`)


class PendingSteps:
    """Steps whose device values have not been read yet (see the module docstring)."""

    def __init__(self) -> None:
        self._records: list[StepRecord] = []

    def __len__(self) -> int:
        return len(self._records)

    @property
    def last_step(self) -> int | None:
        """The step of the newest pending record (None when none is pending)."""
        return self._records[-1].step if self._records else None

    def add(self, record: StepRecord) -> None:
        """Keep a finished step until the next `flush`."""
        self._records.append(record)

    def flush(self, arrays: bool = False) -> list[StepRecord]:
        """Every pending step with its device values replaced by floats (one host read for all of them), oldest
        first; the pending list is then empty. Its 1-D values (`is_array`) are dropped unread, but the last step's
        with `arrays`, which are read with the rest, as lists."""
        records, self._records = self._records, []
        for record in records:
            keep = arrays and record is records[-1]
            for key in [k for k, v in record.scalars.items() if is_array(v) and not keep]:
                del record.scalars[key]
        slots = [(r.scalars, k) for r in records for k, v in r.scalars.items() if isinstance(v, torch.Tensor)]
        for (scalars, key), value in zip(slots, read_to_host([scalars[key] for scalars, key in slots])):
            scalars[key] = value
        return records
