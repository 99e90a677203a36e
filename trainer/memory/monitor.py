"""Memory measurement behind one interface, whatever the device: ``MemoryMonitor`` and its ``MemoryStats``.

The train loop does::

    monitor = MemoryMonitor(device, mode=cfg.track)
    monitor.track(model, optimizer)
    with monitor:
        for step in ...:
            ...train step...
            stats = monitor.step_end()
            metric_logger.log(step, MemoryMonitor.to_scalars(stats))

and never asks which device it runs on: CUDA reads the caching allocator's counters, CPU (which has no
allocator statistics) counts every tensor storage with torch's ``MemTracker`` (``trainer.memory.tracker``).
``MemoryMonitor.dump_table`` writes what the monitor knows right now, the table ``trainer.memory.snapshots``
writes on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from trainer.memory.tracker import _HINT, _TOTAL, _compiled_submodules, _fold, _passes_through_tracker, _StepMemTracker

__all__ = ["MemoryMonitor", "MemoryStats"]

logger = logging.getLogger(__name__)

_GiB = float(1 << 30)
_LEFT_BEHIND = ("activations", "gradients")
"""Step-end categories that a healthy step leaves empty (gradients are freed with set_to_none)."""
_VARYING = ("activations", "gradients", "other")
"""Peak categories that change with the step, the AC mode or the layout's transients."""


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one training step, in bytes; ``None`` (an empty dict for the breakdowns) where not measured.

    Attributes:
        allocated_bytes: tensor memory alive at the end of the step (exact and allocator modes).
        peak_bytes: highest tensor memory since the previous ``step_end`` (since entering the monitor for the
            first step) (exact and allocator modes).
        reserved_bytes: the CUDA caching allocator's reserved bytes (CUDA, exact and allocator modes).
        rss_bytes: the process resident set size (host memory, includes the Python heap and libraries), in every
            mode wherever ``/proc`` can be read.
        num_alloc_retries: CUDA allocations that had to free cached blocks and retry (cumulative; CUDA only).
        num_ooms: CUDA out-of-memory errors caught by the allocator (cumulative; CUDA only).
        breakdown: ``allocated_bytes`` split into parameters, gradients, optimizer_state, activations and
            other (exact mode only, empty otherwise); the values sum to ``allocated_bytes``.
        peak_breakdown: the same split at the moment of the step's peak; sums to ``peak_bytes``.
    """

    allocated_bytes: int | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    rss_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    breakdown: dict[str, int] = field(default_factory=dict)
    peak_breakdown: dict[str, int] = field(default_factory=dict)


def _process_rss_bytes() -> int | None:
    """Resident set size of this process; None where /proc is missing (macOS)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class MemoryMonitor:
    """Per-step memory statistics through one interface on CPU and CUDA.

    Modes:
        ``"auto"``: on CUDA the caching allocator's counters (``torch.cuda.memory_stats``, essentially free);
        on any other device ``"exact"``, because the CPU build has no allocator statistics at all.
        ``"exact"``: torch's ``MemTracker`` (a ``TorchDispatchMode``) counts every tensor storage created in the
        ``with`` block plus what ``track`` registers, broken down into parameters, gradients, optimizer state,
        activations and other. Exact to the byte on CPU, including FSDP2's ``storage.resize_`` (on CUDA each
        storage is rounded up to 512 bytes like the allocator does).
        ``"off"``: no tensor memory is measured; only the process RSS is (it costs nothing).
    In every mode the process RSS is read where ``/proc`` exists; fields that were not measured are ``None``.

    Overhead of exact tracking: every aten op (and every storage it creates) goes through Python. The cost is per
    op, not per byte, so larger per-op work hides it while many tiny ops magnify it (measured in docs/memory.md,
    "What is measured, and how"); use ``"off"`` for benchmarking.

    Limitations of exact mode:
        * ``torch.compile``: dynamo does not run compiled code while a dispatch mode is active; the model runs
          eagerly, and a compiled frame once run under the tracker stays eager even after the ``with`` block.
          ``track`` therefore refuses compiled modules; a compiled free function (a compiled loss) cannot be
          detected and silently runs eagerly under exact tracking.
        * Only tensors created inside the ``with`` block, or registered with ``track``, are counted.
        * Work in other threads (e.g. async checkpoint staging) is not seen.
    FSDP2 (``fully_shard``) works: local shards, unsharded parameters and their ``resize_`` are all counted.

    Use it as a context manager around the whole training loop and call ``step_end`` once per optimizer step.
    An instance is single-use.
    """

    def __init__(self, device: torch.device | str, mode: str = "auto", compiled: bool = False) -> None:
        if mode not in ("auto", "exact", "off"):
            raise ValueError(f'memory tracking mode must be "auto", "exact" or "off", got {mode!r}')
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # MemTracker keys its snapshots by the tensors' device, which always carries an index.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        off_because = "memory.track = off"
        if mode == "auto":
            mode = "allocator" if device.type == "cuda" else "exact"
            if compiled and mode == "exact":
                off_because = ("compile.enable = true: the exact CPU tracker would make compiled code run eagerly, "
                               "and CPU has no allocator counters")
                mode = "off"
        if mode == "off":
            logger.info("memory: tensor memory is not tracked (%s); only the process RSS is measured, so there are "
                        "no tensor memory curves and no leak detection", off_because)
        self.mode = mode
        self._tracker = _StepMemTracker() if mode == "exact" else None
        self._state = "new"  # new -> entered -> exited
        self.last_stats = MemoryStats()
        """What the latest ``step_end`` returned."""

    def track(self, *objects: torch.nn.Module | torch.optim.Optimizer | torch.Tensor) -> None:
        """Count memory of models, optimizers or tensors created before the monitor was entered.

        Call it before entering and again whenever such state appears outside the tracked region (e.g. optimizer
        state loaded from a checkpoint). Storages are counted once however often they are registered, and
        optimizer state created by ``optimizer.step()`` inside the ``with`` block is counted automatically. A
        no-op unless the mode is exact, since the allocator counters already see everything.
        """
        if self._tracker is None:
            return
        for obj in objects:
            if isinstance(obj, torch.nn.Module) and (compiled := _compiled_submodules(obj)):
                names = ", ".join(repr(n) for n in compiled[:3]) + (", ..." if len(compiled) > 3 else "")
                raise ValueError(
                    f"exact memory tracking cannot measure a torch.compile'd model (compiled: {names}): dynamo "
                    f"does not run compiled code while a dispatch mode is active, so the model would silently run "
                    f"eagerly. Disable compile, or: {_HINT}"
                )
        try:
            self._tracker.track_external(*objects)
        except Exception as exc:
            raise RuntimeError(f"exact memory tracking could not register {len(objects)} object(s). {_HINT}") from exc

    def __enter__(self) -> MemoryMonitor:
        if self._state != "new":
            raise RuntimeError("a MemoryMonitor can be entered only once; create a new one")
        if self._tracker is not None:
            try:
                self._tracker.__enter__()
            except Exception as exc:
                raise RuntimeError(f"exact memory tracking (MemTracker) failed to start. {_HINT}") from exc
        elif self.mode == "allocator":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._state = "entered"
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._state = "exited"
        if self._tracker is None:
            return
        self._tracker.__exit__(exc_type, exc, tb)
        self._tracker.reset_mod_stats()
        # Every aten op of the loop runs inside the tracker, so its frames are in the traceback of any op error,
        # not only of the tracker's own failures: a note (not a new exception type) points at the way out
        # without hiding what actually failed. add_note exists from Python 3.11 on.
        if isinstance(exc, Exception) and hasattr(exc, "add_note") and _passes_through_tracker(tb):
            exc.add_note(f"Raised while exact memory tracking was active. If the tracker is at fault: {_HINT}")

    def step_end(self) -> MemoryStats:
        """Statistics of the step that just ended; starts the peak of the next step."""
        if self._state != "entered":
            raise RuntimeError("MemoryMonitor.step_end() must be called inside `with monitor:`")
        if self.mode == "allocator":
            self.last_stats = self._allocator_step_end()
        elif self.mode == "exact":
            self.last_stats = self._exact_step_end()
        else:
            self.last_stats = MemoryStats(rss_bytes=_process_rss_bytes())
        return self.last_stats

    def _allocator_step_end(self) -> MemoryStats:
        stats = torch.cuda.memory_stats(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return MemoryStats(
            allocated_bytes=stats.get("allocated_bytes.all.current", 0),
            peak_bytes=stats.get("allocated_bytes.all.peak", 0),
            reserved_bytes=stats.get("reserved_bytes.all.current", 0),
            rss_bytes=_process_rss_bytes(),
            num_alloc_retries=stats.get("num_alloc_retries", 0),
            num_ooms=stats.get("num_ooms", 0),
        )

    def _exact_step_end(self) -> MemoryStats:
        tracker = self._tracker
        current = tracker.get_tracker_snapshot("current").get(self.device)
        peak = tracker.get_tracker_snapshot("peak").get(self.device)
        # MemTracker appends module-wise snapshots on every module call; clearing them each step keeps that
        # history (host memory) from growing over the run. The peak restarts here so that peak_bytes is the
        # peak of the coming step only.
        tracker.reset_mod_stats()
        tracker.reset_peak()
        reserved = retries = ooms = None  # CPU has no caching allocator
        if self.device.type == "cuda":
            cuda_stats = torch.cuda.memory_stats(self.device)
            reserved = cuda_stats.get("reserved_bytes.all.current", 0)
            retries, ooms = cuda_stats.get("num_alloc_retries", 0), cuda_stats.get("num_ooms", 0)
        return MemoryStats(
            allocated_bytes=(current or {}).get(_TOTAL, 0),
            peak_bytes=(peak or {}).get(_TOTAL, 0),
            reserved_bytes=reserved,
            rss_bytes=_process_rss_bytes(),
            num_alloc_retries=retries,
            num_ooms=ooms,
            breakdown=_fold(current),
            peak_breakdown=_fold(peak),
        )

    @staticmethod
    def to_scalars(stats: MemoryStats) -> dict[str, float]:
        """Tensorboard-ready scalars of the measured fields only: sizes in GiB under ``memory/``, counters as plain
        numbers. A field that was not measured has no tag (a 0 would read as a measurement).

        Of the breakdowns, only what tells steps and runs apart: at the peak, activations, gradients and other
        (parameters and optimizer state are the same at every step); at step end, activations and gradients only
        where some are left (a healthy step leaves a few hundred bytes at most: a chart of them is a leak's trace,
        not a flat zero)."""
        sizes = {"allocated": stats.allocated_bytes, "peak_allocated": stats.peak_bytes,
                 "reserved": stats.reserved_bytes, "rss": stats.rss_bytes}
        scalars = {f"memory/{name}_GiB": nbytes / _GiB for name, nbytes in sizes.items() if nbytes is not None}
        counters = {"num_alloc_retries": stats.num_alloc_retries, "num_ooms": stats.num_ooms}
        scalars.update({f"memory/{name}": float(n) for name, n in counters.items() if n is not None})
        for name in _LEFT_BEHIND:
            if stats.breakdown.get(name):
                scalars[f"memory/breakdown/{name}_GiB"] = stats.breakdown[name] / _GiB
        for name in _VARYING:
            if name in stats.peak_breakdown:
                scalars[f"memory/peak_breakdown/{name}_GiB"] = stats.peak_breakdown[name] / _GiB
        return scalars

    def dump_table(self, path: str) -> dict[str, Any]:
        """Write what the monitor knows about memory right now to ``path``; returns the same content as a dict.

        ``path`` ending in ``.json`` gets JSON, anything else an aligned text table. Content by mode:
            exact: the last step's statistics; the tracker's current bytes per MemTracker category; live
            storages per category (count and bytes: a leak shows up as a count that grows by the same number
            every step); the 20 largest live storages; and per module of the last finished step, the number of
            forward calls, the bytes its forward left allocated (activations kept for backward plus the output)
            and the highest total while its forward or backward ran.
            allocator: the last step's statistics and ``torch.cuda.memory_stats``.
            off: only the device and the mode.
        """
        table: dict[str, Any] = {"device": str(self.device), "mode": self.mode}
        if self.mode != "off":
            table["last_step"] = dataclasses.asdict(self.last_stats)
        if self.mode == "allocator":
            table["allocator"] = torch.cuda.memory_stats(self.device)
        elif self.mode == "exact":
            table.update(self._tracker.table(self.device))
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            if path.endswith(".json"):
                json.dump(table, f, indent=1)
            else:
                f.write(_format_table(table))
        return table


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:12.3f}"


def _format_table(table: dict[str, Any]) -> str:
    """Render ``dump_table``'s content for people: sizes in MiB, one aligned section per part."""
    lines = [f"memory on {table['device']} (mode {table['mode']})"]
    last = table.get("last_step")
    if last:
        sizes = [f"{name} {last[f'{name}_bytes'] / 2**20:.3f} MiB" for name in ("allocated", "peak", "reserved", "rss")
                 if last[f"{name}_bytes"] is not None]
        lines.append("last step: " + ", ".join(sizes))
    if "current" in table:
        lines += ["", f"{'category':<14}{'MiB now':>12}{'storages':>10}"]
        for name, nbytes in table["current"].items():
            count = table["live_storages"].get(name, {}).get("count", "")
            lines.append(f"{name:<14}{_mib(nbytes)}{count:>10}")
        lines += ["", f"{'largest live storages (MiB)':<28}category"]
        lines += [f"{_mib(s['bytes']):<28}{s['category']}" for s in table["largest_storages"]]
        lines += ["", f"{'module (last step)':<48}{'calls':>6}{'fw kept MiB':>13}{'peak fw MiB':>13}"]
        for row in table["modules"]:
            lines.append(f"{row['module']:<48}{row['forward_calls']:>6}{_mib(row['forward_retained_bytes']):>13}"
                         f"{_mib(row['peak_forward_bytes']):>13}")
    if "allocator" in table:
        lines += [""] + [f"{key:<56}{value}" for key, value in sorted(table["allocator"].items())]
    return "\n".join(lines) + "\n"
