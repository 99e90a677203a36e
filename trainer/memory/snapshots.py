"""Memory snapshots of one rank: what a person needs to find where memory went.

``MemorySnapshots`` writes CUDA allocator snapshots (with allocation history when recording is on) for
pytorch.org/memory_viz, or on CPU the exact tracker's table (``MemoryMonitor.dump_table``), every N steps, on a
leak alarm and on CUDA out-of-memory.
"""

from __future__ import annotations

import logging
import os
import pickle
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from trainer.memory.monitor import MemoryMonitor

if TYPE_CHECKING:
    from trainer.memory.leak_detector import LeakVerdict

__all__ = ["MemorySnapshots"]

logger = logging.getLogger(__name__)


_MAX_HISTORY_ENTRIES = 100_000  # alloc/free events kept by CUDA history recording (several KB of host memory each)


class MemorySnapshots:
    """Writes memory snapshots of one rank into ``folder``: every ``freq`` steps, on a leak alarm, on CUDA OOM.

    On CUDA a snapshot is the caching allocator's state (``torch.cuda.memory._snapshot()``) as a pickle that
    pytorch.org/memory_viz opens; with ``freq > 0`` the allocator also records every allocation and free with
    its stack trace from ``__enter__`` on (a small cost per allocation, see docs/memory.md, "Snapshots"), so the
    snapshots show where each block came from, and an OOM snapshot shows the allocations that led up to it. With
    ``freq == 0`` nothing is recorded and an OOM snapshot shows the allocator's blocks only. In exact mode a
    ``.json`` table (``MemoryMonitor.dump_table``) is written next to it; on CPU the table is the snapshot.

    Files are named ``rank<r>_step<step>_<reason>.{pickle,json}`` with reason ``periodic``, ``leak`` or ``oom``.
    Use it as a context manager around the loop (inside or outside the monitor's ``with``), call ``step_end``
    after each step, and pass ``on_leak`` to the leak detector.
    """

    def __init__(self, monitor: MemoryMonitor, folder: str, freq: int = 0, dump_on_leak: bool = True,
                 rank: int = 0) -> None:
        self.monitor = monitor
        self.folder = folder
        self.freq = freq
        self.dump_on_leak = dump_on_leak
        self.rank = rank
        self.step = 0
        self._cuda = monitor.device.type == "cuda"
        self._recording = False

    def __enter__(self) -> MemorySnapshots:
        if self._cuda and self.freq > 0:
            torch.cuda.memory._record_memory_history(max_entries=_MAX_HISTORY_ENTRIES)
            self._recording = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._cuda and isinstance(exc, torch.OutOfMemoryError):
                # The traceback still holds the frames of the failed step, so their tensors are in the snapshot.
                self.step += 1  # name the file after the step that failed, not the last one that finished
                path = self.dump("oom")
                logger.error("CUDA out of memory at step %d; memory snapshot written to %s", self.step, path)
        finally:
            if self._recording:
                torch.cuda.memory._record_memory_history(enabled=None)
                self._recording = False

    def step_end(self, step: int) -> str | None:
        """Note that ``step`` finished; writes a periodic snapshot every ``freq`` steps and returns its path."""
        self.step = step
        if self.freq > 0 and step % self.freq == 0:
            return self.dump("periodic")
        return None

    def on_leak(self, verdict: LeakVerdict) -> None:
        """Leak-detector callback: a snapshot of the leaking state, when ``dump_on_leak`` is set."""
        if self.dump_on_leak:
            logger.warning("memory snapshot of the leak written to %s", self.dump("leak"))

    def dump(self, reason: str) -> str:
        """Write a snapshot now; returns the path of the main file (the pickle on CUDA, the table on CPU)."""
        os.makedirs(self.folder, exist_ok=True)
        stem = os.path.join(self.folder, f"rank{self.rank}_step{self.step:06d}_{reason}")
        path = stem + ".json"
        if self.monitor.mode == "exact" or not self._cuda:
            self.monitor.dump_table(path)
        if self._cuda:
            path = stem + ".pickle"
            with open(path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(self.monitor.device), f)
        return path
