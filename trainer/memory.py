"""Memory measurement behind one interface, whatever the device.

The train loop does::

    monitor = MemoryMonitor(device, mode=cfg.track)
    monitor.track(model, optimizer)
    with monitor:
        for step in ...:
            ...train step...
            stats = monitor.step_end()
            metric_logger.log(step, MemoryMonitor.to_scalars(stats))

and never asks which device it runs on: CUDA reads the caching allocator's counters, CPU (which has no
allocator statistics) counts every tensor storage with torch's ``MemTracker``.

``MemorySnapshots`` writes what a person needs to find where memory went: CUDA allocator snapshots (with
allocation history when recording is on) for pytorch.org/memory_viz, or on CPU the exact tracker's table
(``MemoryMonitor.dump_table``), every N steps, on a leak alarm and on CUDA out-of-memory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import weakref
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed._tools import mem_tracker as _mem_tracker_module
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils.weak import WeakIdKeyDictionary

from core.config import option

if TYPE_CHECKING:
    from trainer.leak_detector import LeakVerdict


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


__all__ = ["MemoryMonitor", "MemorySnapshots", "MemoryStats"]

logger = logging.getLogger(__name__)

_GiB = float(1 << 30)

# MemTracker's seven categories folded into the five the trainer reports. Buffers (RoPE tables, expert bias)
# are model state but not parameters, so they go to "other" and "parameters" stays exactly sum(numel * itemsize).
# "Temp" is backward-only transient memory (gradients of activations), the backward half of activation memory.
_CATEGORY = {
    "Parameter": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "activations",
    "Buffer": "other",
    "Other": "other",
}
_TOTAL = "Total"
# MemTracker and the ModTracker it drives live here; used to recognise their frames in a traceback.
_TRACKER_DIR = os.path.dirname(_mem_tracker_module.__file__)

_HINT = (
    'Set memory.track = "off" to train without memory tracking (or "auto" on CUDA, which reads the cheap '
    "allocator counters instead of tracking every tensor)."
)


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


class _ForwardOnlyModTracker(ModTracker):
    """ModTracker without its backward hooks.

    Stock ModTracker registers a multi-grad hook on every module's inputs and outputs in every forward; in torch
    2.13 those hooks keep host memory alive (process RSS grows every step while tensor memory stays flat; measured
    in docs/memory.md, "Host memory under exact tracking"). The memory totals do not need them (backward is
    detected from the autograd engine), so only the per-module backward statistics are given up.
    """

    def _fw_pre_hook(self, mod, input):
        if torch._dynamo.eval_frame._is_in_optimized_module():
            return
        w_mod = weakref.ref(mod)
        self._get_append_fn(w_mod, self._get_mod_name(mod), False)()
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)

    def _fw_post_hook(self, mod, input, output):
        if torch._dynamo.eval_frame._is_in_optimized_module():
            return
        w_mod = weakref.ref(mod)
        if self._user_post_fw_hook is not None:
            self._user_post_fw_hook(mod, input, output)
        self._get_pop_fn(w_mod, self._get_mod_name(mod), False)()


class _StepMemTracker(MemTracker):
    """``MemTracker`` with a per-step peak and tolerance for several forward calls per step.

    Relies on private parts of ``MemTracker``: its ``_pre_fw_hook``, its ``_peak_mem``/``_peak_mem_snap`` fields
    and its ``_WINFO`` table of live storages (read by ``MemoryMonitor.dump_table``). The constructor turns a
    missing one into a clear error, should a torch upgrade rename them.
    """

    def __init__(self) -> None:
        super().__init__()
        internals = ("_pre_fw_hook", "_peak_mem", "_peak_mem_snap", "_WINFO")
        if not all(hasattr(self, name) for name in internals):
            raise RuntimeError(f"this torch's MemTracker lacks the internals exact memory tracking relies on. {_HINT}")
        self.last_step_mod_stats: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._mod_tracker = _ForwardOnlyModTracker()

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:
            # MemTracker refuses a second top-level forward of a module before reset_mod_stats(), but gradient
            # accumulation and pipeline microbatches do exactly that within one step. The per-module stats it
            # guards are never read here, so forget the module's stale entry and record this call afresh.
            # Submodules keep their entries: a pending backward of an earlier microbatch still needs them.
            del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    def reset_peak(self) -> None:
        """Restart peak tracking from the current usage.

        MemTracker keeps one peak from ``__enter__`` on and offers no reset, so without this the peak of every
        later step would be the peak of the whole run.
        """
        self._peak_mem_snap = self.get_tracker_snapshot("current")
        self._peak_mem = {dev: snap[_TOTAL] for dev, snap in self._peak_mem_snap.items()}

    def reset_mod_stats(self) -> None:
        """Start the next step's per-module statistics, keeping the finished step's for ``MemoryMonitor.dump_table``.

        MemTracker clears its table in place; handing it a fresh one instead keeps the last step's readable at
        no cost (one step's worth of module snapshots is held, never more).
        """
        self.last_step_mod_stats = self.memory_tracking
        self.memory_tracking = WeakIdKeyDictionary()


def _fold(snapshot: dict[str, int] | None) -> dict[str, int]:
    """Fold one device's MemTracker snapshot into the trainer's five categories."""
    folded = dict.fromkeys(_CATEGORY.values(), 0)
    for key, nbytes in (snapshot or {}).items():
        # Keys are str-valued enums whose hash differs from their string value, so compare by value.
        name = getattr(key, "value", key)
        if name != _TOTAL:
            folded[_CATEGORY[name]] += nbytes
    return folded


def _process_rss_bytes() -> int | None:
    """Resident set size of this process; None where /proc is missing (macOS)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _passes_through_tracker(tb: TracebackType | None) -> bool:
    """Whether a traceback contains a frame of torch's memory/module trackers."""
    while tb is not None:
        if os.path.dirname(tb.tb_frame.f_code.co_filename) == _TRACKER_DIR:
            return True
        tb = tb.tb_next
    return False


def _compiled_submodules(module: torch.nn.Module) -> list[str]:
    """Names of submodules wrapped by ``torch.compile`` or compiled in place with ``Module.compile()``."""
    return [
        name or type(module).__name__
        for name, sub in module.named_modules()
        if isinstance(sub, OptimizedModule) or getattr(sub, "_compiled_call_impl", None) is not None
    ]


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
        numbers. A field that was not measured has no tag (a 0 would read as a measurement)."""
        sizes = {"allocated": stats.allocated_bytes, "peak_allocated": stats.peak_bytes,
                 "reserved": stats.reserved_bytes, "rss": stats.rss_bytes}
        scalars = {f"memory/{name}_GiB": nbytes / _GiB for name, nbytes in sizes.items() if nbytes is not None}
        counters = {"num_alloc_retries": stats.num_alloc_retries, "num_ooms": stats.num_ooms}
        scalars.update({f"memory/{name}": float(n) for name, n in counters.items() if n is not None})
        for name, nbytes in stats.breakdown.items():
            scalars[f"memory/breakdown/{name}_GiB"] = nbytes / _GiB
        for name, nbytes in stats.peak_breakdown.items():
            scalars[f"memory/peak_breakdown/{name}_GiB"] = nbytes / _GiB
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
            table.update(self._exact_table())
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            if path.endswith(".json"):
                json.dump(table, f, indent=1)
            else:
                f.write(_format_table(table))
        return table

    def _exact_table(self) -> dict[str, Any]:
        tracker = self._tracker
        current = tracker.get_tracker_snapshot("current").get(self.device, {})
        per_category: dict[str, dict[str, int]] = {}
        sizes = []
        for winfo, weak_storage in list(tracker._WINFO.values()):
            if weak_storage() is None or winfo.device != self.device:
                continue
            name = winfo.reftype.value
            entry = per_category.setdefault(name, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += winfo.mem_consumed
            sizes.append((winfo.mem_consumed, name))
        sizes.sort(reverse=True)
        return {
            "current": {getattr(k, "value", k): v for k, v in current.items()},
            "live_storages": per_category,
            "largest_storages": [{"bytes": b, "category": c} for b, c in sizes[:_LARGEST]],
            "modules": [_module_row(stats, self.device) for stats in list(tracker.last_step_mod_stats.values())],
        }


_LARGEST = 20  # storages listed by size in a table: enough to see what dominates, short enough to read


def _state_totals(stats: Any, state: str, device: torch.device) -> list[int]:
    """Total bytes on ``device`` at each recorded occurrence of a module state (e.g. "Pre-Forward")."""
    for key, snaps in stats.snapshots.items():
        if getattr(key, "value", key) == state:
            return [snap.get(device, {}).get(_TOTAL, 0) for snap in snaps]
    return []


def _module_row(stats: Any, device: torch.device) -> dict[str, Any]:
    """One module's line of the table, from MemTracker's per-module snapshots of one step."""
    pre, post = _state_totals(stats, "Pre-Forward", device), _state_totals(stats, "Post-Forward", device)
    return {
        "module": stats.mod_fqn,
        "forward_calls": len(pre),
        "forward_retained_bytes": sum(b - a for a, b in zip(pre, post)),
        "peak_forward_bytes": max(_state_totals(stats, "Peak-Forward", device), default=0),
    }


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
