"""The exact tracker: torch's ``MemTracker`` adapted to a training loop, and everything that reads its internals.

``MemTracker`` (``torch.distributed._tools``, a ``TorchDispatchMode``) counts every tensor storage, which is what
CPU needs since its build has no allocator statistics (``trainer.memory.monitor`` uses it in exact mode). Its
public API gives totals per category since ``__enter__``; a training loop also needs a peak per step, several
forward calls of one module per step (gradient accumulation, pipeline microbatches), host memory that stays flat,
and a table of what is alive. Those come from torch-private parts, all of them used in this module and nowhere
else, so that a torch upgrade that renames one breaks here only:

* ``MemTracker._pre_fw_hook``, ``_update_peak_stats``, ``_peak_mem``, ``_peak_mem_snap``, ``_curr_mem_snap``,
  ``_mod_tracker``: overridden or reset for the per-step peak, repeated forwards and a peak update that costs the
  depth of the module stack instead of the number of modules (``_StepMemTracker``; its constructor checks they
  exist).
* ``MemTracker._WINFO`` (live storages, each a ``_WeakRefInfo`` with ``reftype``, ``device``, ``mem_consumed``)
  and ``memory_tracking`` (per-module ``_ModMemStats`` with ``mod_fqn`` and ``snapshots``): read for the table.
* ``ModTracker._fw_pre_hook``/``_fw_post_hook`` (overridden), ``_get_append_fn``, ``_get_pop_fn``,
  ``_get_mod_name``, ``_user_pre_fw_hook``/``_user_post_fw_hook``: the forward-only module tracker.
* ``torch._dynamo.eval_frame._is_in_optimized_module``, ``OptimizedModule`` and ``Module._compiled_call_impl``:
  which modules are compiled, since dynamo does not run compiled code under a dispatch mode.

Written against torch 2.13 (the dev pin); docs/torch_versions.md records them present in torch 2.11.0 too, the
oldest supported version.
"""

from __future__ import annotations

import os
import weakref
from types import TracebackType
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule
from torch._guards import active_fake_mode
from torch.distributed._tools import mem_tracker as _mem_tracker_module
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils.weak import WeakIdKeyDictionary

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


class _ForwardOnlyModTracker(ModTracker):
    """ModTracker without its backward hooks.

    Stock ModTracker registers a multi-grad hook on every module's inputs and outputs in every forward; in torch
    2.13 those hooks keep host memory alive (process RSS grows every step while tensor memory stays flat; measured
    in docs/memory.md, "Host memory under exact tracking"). The memory totals do not need them (backward is
    detected from the autograd engine), so only the per-module backward statistics are given up.

    The two hooks are torch 2.13's ``ModTracker._fw_pre_hook``/``_fw_post_hook`` without their
    ``register_multi_grad_hook`` calls; compare them with the installed torch's after an upgrade.
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
    and its ``_WINFO`` table of live storages (read by ``table``). The constructor turns a missing one into a
    clear error, should a torch upgrade rename them.
    """

    def __init__(self) -> None:
        super().__init__()
        # the methods on MemTracker itself (this class overrides them), the fields on the instance
        methods, fields = ("_pre_fw_hook", "_update_peak_stats"), ("_peak_mem", "_peak_mem_snap", "_curr_mem_snap",
                                                                    "_WINFO")
        if not (all(hasattr(MemTracker, n) for n in methods) and all(hasattr(self, n) for n in fields)):
            raise RuntimeError(f"this torch's MemTracker lacks the internals exact memory tracking relies on. {_HINT}")
        self.last_step_mod_stats: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # the FakeTensorMode active when entered, if any, where torch's MemTracker does not keep it (__torch_dispatch__)
        self._fake_mode_at_entry = None
        self._skip_fake_propagation = False
        self._mod_tracker = _ForwardOnlyModTracker()
        # memory_tracking's stats by module name, for _update_peak_stats (a list: two roots may share a name)
        self._stats_by_fqn: dict[str, list[Any]] = {}

    def __enter__(self) -> "_StepMemTracker":
        outermost = getattr(self, "_depth", 0) == 0
        fake_mode = active_fake_mode()
        super().__enter__()
        if outermost:
            # torch 2.13's MemTracker keeps the entry's fake mode itself (_fake_mode_on_entry) and skips DTensor's
            # propagation ops; 2.11's does neither, so this class does it there
            self._skip_fake_propagation = not hasattr(self, "_fake_mode_on_entry")
            self._fake_mode_at_entry = fake_mode
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        """DTensor's sharding propagation runs ops on fake tensors under a FakeTensorMode of its own: they hold
        no memory, so they run untracked. torch 2.13's MemTracker skips them itself (the mode lookup, 3 us an op
        against 124 us for a tracked op, is not done twice there); 2.11's counted them, and the first step of a
        4-rank FSDP + EP run on CPU peaked 0.18 GiB above the same run on 2.13."""
        if self._skip_fake_propagation and active_fake_mode() is not self._fake_mode_at_entry:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        before = self.memory_tracking.get(module)
        # MemTracker renames a module's stats when its name changed (a module first called alone, then inside a
        # parent seen for the first time): the stats are filed again under the new name
        before_fqn = before.mod_fqn if before is not None else None
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:
            # MemTracker refuses a second top-level forward of a module before reset_mod_stats(), but gradient
            # accumulation and pipeline microbatches do exactly that within one step. The per-module stats it
            # guards are never read here, so forget the module's stale entry and record this call afresh.
            # Submodules keep their entries: a pending backward of an earlier microbatch still needs them.
            del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)
        stats = self.memory_tracking[module]
        if stats is not before or stats.mod_fqn != before_fqn:
            if before is not None:
                self._stats_by_fqn[before_fqn].remove(before)
            self._stats_by_fqn.setdefault(stats.mod_fqn, []).append(stats)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """MemTracker's update after every op, for the modules now running only.

        Stock MemTracker loops over every module seen this step and skips those not running; that loop was a third
        of the tracker's time, and the tracker half of a CPU test's (tests/test_plan.py's layouts, py-spy). Here
        the running modules are looked up by name, and snapshots (flat dicts of ints) are copied shallowly. The
        result is the same: tests/test_memory.py compares it with stock MemTracker's.
        """
        curr_snap = self._curr_mem_snap
        for fqn in self._mod_tracker.parents:
            for mod_stats in self._stats_by_fqn.get(fqn, ()):
                if peak_state in mod_stats.snapshots:
                    for dev, dev_snap in curr_snap.items():
                        if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL]:
                            mod_stats.local_peak[dev] = dev_snap[_TOTAL]
                            mod_stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL]:
                self._peak_mem[dev] = dev_snap[_TOTAL]
                self._peak_mem_snap[dev] = dict(dev_snap)

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
        self._stats_by_fqn = {}

    def table(self, device: torch.device) -> dict[str, Any]:
        """The exact-mode part of ``MemoryMonitor.dump_table`` for ``device``: current bytes per MemTracker
        category, live storages per category, the largest live storages and the last finished step's modules."""
        current = self.get_tracker_snapshot("current").get(device, {})
        per_category: dict[str, dict[str, int]] = {}
        sizes = []
        for winfo, weak_storage in list(self._WINFO.values()):
            if weak_storage() is None or winfo.device != device:
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
            "modules": [_module_row(stats, device) for stats in list(self.last_step_mod_stats.values())],
        }


def _fold(snapshot: dict[str, int] | None) -> dict[str, int]:
    """Fold one device's MemTracker snapshot into the trainer's five categories."""
    folded = dict.fromkeys(_CATEGORY.values(), 0)
    for key, nbytes in (snapshot or {}).items():
        # Keys are str-valued enums whose hash differs from their string value, so compare by value.
        name = getattr(key, "value", key)
        if name != _TOTAL:
            folded[_CATEGORY[name]] += nbytes
    return folded


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
