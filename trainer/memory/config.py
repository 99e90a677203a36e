"""The ``[memory]`` config section: tracking mode, leak detection and snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import option

__all__ = ["MemorySection"]


@dataclass
class MemorySection:
    """Memory tracking and leak detection."""

    track: str = option("auto", choices=["auto", "exact", "off"])
    """auto = exact on CPU and cheap allocator statistics on CUDA; exact = account every tensor on any device
    (slower); off = no tracking."""
    fail_on_leak: bool = False
    """Stop the run with an error when memory grows from step to step instead of only reporting it."""
    leak_warmup_steps: int = option(5, ge=0)
    """Steps the leak detector ignores at the start, while optimizer state and caches are created."""
    leak_window: int = option(10, ge=3, special=0)
    """Steps the leak detector fits its slope over; 0 = no leak detection. The alarm needs the slope above
    the threshold for half a window in a row. A leak that grows only every k steps (e.g. only in validation)
    is caught when the window is at least 2 * k."""
    leak_threshold_MiB_per_step: float = option(0.1, gt=0)
    """Growth of the memory allocated at step end above which the detector reports a leak (0.1 MiB/step
    adds up to about 10 GiB over 100k steps; a healthy run measures 0)."""
    snapshot_freq: int = option(0, ge=0)
    """Write a memory snapshot to dump_folder/memory_snapshots every this many steps; 0 = off. CUDA: an
    allocator snapshot with allocation history and stack traces (recorded from the start when > 0; open in
    pytorch.org/memory_viz); CPU: the exact tracker's table as JSON."""
    dump_on_leak: bool = True
    """Write a memory snapshot when the leak detector raises its alarm."""
