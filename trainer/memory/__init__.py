"""Memory you can see: per-step measurement, leak detection and snapshots, one concern per module.

- ``config``: the ``[memory]`` config section (``MemorySection``).
- ``monitor``: ``MemoryMonitor`` and its ``MemoryStats``, one interface for the exact tracker, the CUDA
  allocator's counters and the process RSS; the scalars the loop logs and the table of what is alive.
- ``tracker``: the exact tracker, torch's ``MemTracker`` adapted to a training loop; the only module that touches
  torch-private internals (listed at its top).
- ``snapshots``: ``MemorySnapshots``, allocator snapshots or tracker tables every N steps, on a leak alarm and on
  CUDA out-of-memory.
- ``leak_detector``: ``LeakDetector``, the Theil-Sen slope of the memory allocated at step end.

Import from the defining module (``from trainer.memory.monitor import MemoryMonitor``); this package re-exports
nothing. ``python -m trainer.plot_memory`` draws a run's curves offline. See docs/memory.md.
"""
