"""Leak detection from what is left at the end of each step: the memory allocated (`MEMORY`), and the MoE comm
backend's live handles (`HANDLES`: a handle a dispatch never released keeps its buffers alive, torchtitan #2296).

In a healthy run the memory alive at step end (parameters, gradients if kept, optimizer state, buffers) is
flat once the first steps have created the optimizer state: the exact CPU tracker measures it as constant to
the byte, and the CUDA allocator's ``allocated_bytes`` behaves the same. A leak makes it climb, step after step,
while loss and throughput look normal (torchtitan #979, #1467, #2273: see docs/memory.md).

The detector fits a robust slope to the last ``window`` step-end values: the Theil-Sen estimator, the median of
the slopes between every pair of points. The median ignores single-step spikes, and it survives noise that a
least-squares fit would follow. A one-time level shift (a lazily built cache, the first validation pass)
lifts that median above zero only while the shift sits near the middle of the window, for about 30% of a
window's positions; a leak keeps it up for good. So the alarm needs the slope above the threshold for
``window // 2`` consecutive steps: a single shift never raises it, a per-step leak raises it
``warmup_steps + window + window // 2 - 1`` steps into the run (19 with the defaults), and a leak that only
grows every ``k`` steps (e.g. only in validation) is caught while the window spans at least two periods
(``window >= 2 * k``, measured: periods up to 6 steps are caught with window 10).

The same detector watches the live handles, which a healthy run holds none of at step end, with a threshold of
`HANDLE_THRESHOLD_PER_STEP` handles per step.

Typical use in the loop::

    detector = LeakDetector.from_config(cfg.memory, on_leak=snapshots.on_leak)
    ...
    verdict = detector.update(step, stats.allocated_bytes, stats.breakdown)
    scalars.update(detector.scalars(verdict))
    ...  # log the step's scalars (the alarm's step reaches tensorboard), then
    detector.check()  # raises MemoryLeakError after the alarm when fail_on_leak is set
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from statistics import median

__all__ = ["ALARM_RANK_TAG", "ALARM_TAG", "HANDLES", "HANDLE_THRESHOLD_PER_STEP", "MEMORY", "SLOPE_TAG",
           "LeakDetector", "LeakVerdict", "MemoryLeakError", "Watched", "theil_sen_slope"]

logger = logging.getLogger(__name__)

_MiB = float(1 << 20)
SLOPE_TAG = "memory/leak_slope_MiB_per_step"
"""Tensorboard tag of the slope, logged every step once the window is full."""
ALARM_TAG = "memory/leak_alarm"
"""Tensorboard tag logged once, with the value 1, at the step the detector raised its alarm (in a rank's folder:
its own alarm; in the run folder: any rank's)."""
ALARM_RANK_TAG = "memory/leak_alarm_rank"
"""Run-folder tag logged beside ``ALARM_TAG``: the (lowest) rank whose detector raised the alarm at that step."""


@dataclass(frozen=True)
class Watched:
    """What a detector watches at each step end: how its leak is named, its unit, and its tensorboard tags."""

    leak: str
    """The leak's name in the warning (``memory leak``)."""
    grows: str
    """What grows, with its verb (``memory allocated at step end grows``)."""
    unit: str
    """The unit of its slope in messages and tensorboard (``MiB``)."""
    unit_size: float
    """The unit in the values the detector is fed (bytes per MiB)."""
    slope_tag: str
    """Tag of the slope, logged every step once the window is full (a rank's folder)."""
    alarm_tag: str
    """Tag logged once, with the value 1, at the step of the alarm (a rank's folder: its own; the run folder: any
    rank's)."""
    alarm_rank_tag: str
    """Run-folder tag beside ``alarm_tag``: the (lowest) rank whose detector raised the alarm at that step."""


MEMORY = Watched("memory leak", "memory allocated at step end grows", "MiB", _MiB, SLOPE_TAG, ALARM_TAG, ALARM_RANK_TAG)
"""The memory allocated at step end, in bytes (the default)."""
HANDLES = Watched("handle leak", "MoE comm handles alive at step end grow", "handles", 1.0,
                  "moe/live_handles/leak_slope_per_step", "moe/live_handles/leak_alarm",
                  "moe/live_handles/leak_alarm_rank")
"""The MoE comm backend's handles alive at step end (0 in a healthy run)."""
HANDLE_THRESHOLD_PER_STEP = 0.1
"""Growth of the live handles above which the detector reports a handle leak: one handle every 10 steps (a leaking
dispatch leaks one per MoE layer and forward, 1 or more per step)."""


class MemoryLeakError(RuntimeError):
    """Raised by ``LeakDetector.check`` after the alarm when ``fail_on_leak`` is set; the message is one line."""


def theil_sen_slope(xs: list[float], ys: list[float]) -> float:
    """Median of the slopes ``(ys[j] - ys[i]) / (xs[j] - xs[i])`` over all pairs with distinct x."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    if not slopes:
        raise ValueError("the Theil-Sen slope needs at least two distinct x values")
    return median(slopes)


@dataclass(frozen=True)
class LeakVerdict:
    """The detector's reading at one step, once its window is full.

    Attributes:
        step: the step of this reading.
        first_step: the first step of the window the slope was fitted on (``step`` is the last).
        slope_per_step: Theil-Sen slope over the window of the watched values (bytes for memory, handles).
        threshold_per_step: the slope above which growth counts as a leak (same unit).
        leaking: the slope has been above the threshold for the confirmation span (``window // 2`` steps).
        growth_by_category: bytes each memory category (parameters, activations, ...) grew by over the window,
            when the caller passed a breakdown; empty otherwise.
        where: the rank it is about, with its place in the layout (e.g. ``rank 5 (stage 1, EP rank 1 of 4)``);
            empty in a single process.
        watched: what the detector watches (``MEMORY``, ``HANDLES``).
    """

    step: int
    first_step: int
    slope_per_step: float
    threshold_per_step: float
    leaking: bool
    growth_by_category: Mapping[str, int]
    where: str = ""
    watched: Watched = MEMORY

    @property
    def slope_MiB_per_step(self) -> float:
        """The slope in bytes per step over a MiB (memory)."""
        return self.slope_per_step / _MiB

    def message(self) -> str:
        """One line describing the leak: rate, step range, threshold and the category that grew most."""
        w = self.watched
        text = (f"{self.where + ': ' if self.where else ''}{w.leak}: {w.grows} "
                f"{self.slope_per_step / w.unit_size:.4g} {w.unit}/step "
                f"(Theil-Sen slope over steps {self.first_step}-{self.step}; threshold "
                f"{self.threshold_per_step / w.unit_size:.4g} {w.unit}/step)")
        if self.growth_by_category:
            name, grown = max(self.growth_by_category.items(), key=lambda kv: kv[1])
            if grown > 0:
                text += f", mostly {name} (+{grown / _MiB:.4g} MiB over the window)"
        return text


class LeakDetector:
    """Watches a value left at the end of every step (the memory allocated, by default) and flags sustained growth.

    Args:
        warmup_steps: updates ignored at the start (optimizer state and caches are created there).
        window: steps the slope is fitted over (at least 3); the slope is reported from the step the window is
            first full, and the alarm needs it above the threshold for ``window // 2`` consecutive steps.
        threshold_per_step: slopes above this count as a leak (bytes per step for memory).
        fail_on_leak: ``check`` raises ``MemoryLeakError`` once the alarm went off, instead of only a warning
            being logged; ``update`` never raises, so that the caller can first log the alarm's step.
        on_leak: called once with the alarm's verdict before the warning or the error (e.g. to dump a memory
            snapshot); its own errors are logged, not raised, so that they cannot hide the leak report.
        enabled: ``False`` makes ``update`` a no-op returning None (no tracking, so nothing to watch).
        warn: log the warning at the alarm; offline analysis (``trainer.plot_memory``) reports by itself.
        where: the rank this detector watches, with its place in the layout, named in its verdicts' messages.
        watched: what it watches: ``MEMORY`` (bytes) or ``HANDLES`` (a count), for its messages and tags.

    The alarm is raised once per run: one warning, however long the leak lasts. The slope keeps being reported.
    """

    def __init__(self, warmup_steps: int = 5, window: int = 10, threshold_per_step: float = 0.1 * _MiB,
                 fail_on_leak: bool = False, on_leak: Callable[[LeakVerdict], object] | None = None,
                 enabled: bool = True, warn: bool = True, where: str = "", watched: Watched = MEMORY) -> None:
        if window < 3:
            raise ValueError(f"leak window must be at least 3 steps, got {window}")
        if warmup_steps < 0 or threshold_per_step <= 0:
            raise ValueError("leak warmup_steps must be >= 0 and threshold_per_step > 0")
        self.warmup_steps = warmup_steps
        self.window = window
        self.confirm_steps = window // 2
        self.threshold_per_step = float(threshold_per_step)
        self.watched = watched
        self.fail_on_leak = fail_on_leak
        self.on_leak = on_leak
        self.enabled = enabled
        self.warn = warn
        self.where = where
        self.alarm: LeakVerdict | None = None
        """The verdict that raised the alarm, once it has been raised."""
        self._updates = 0
        self._points: deque[tuple[int, int, Mapping[str, int]]] = deque(maxlen=window)
        self._above = 0

    @classmethod
    def from_config(cls, cfg, on_leak: Callable[[LeakVerdict], object] | None = None,
                    where: str = "") -> LeakDetector:
        """A detector for the ``[memory]`` config section; disabled when tracking is off or ``leak_window`` is 0."""
        return cls(warmup_steps=cfg.leak_warmup_steps, window=max(cfg.leak_window, 3),
                   threshold_per_step=cfg.leak_threshold_MiB_per_step * _MiB,
                   fail_on_leak=cfg.fail_on_leak, on_leak=on_leak,
                   enabled=cfg.track != "off" and cfg.leak_window > 0, where=where)

    @classmethod
    def for_handles(cls, cfg, where: str = "") -> LeakDetector:
        """A detector of the MoE comm backend's live handles for the ``[memory]`` section: its warm-up, window and
        ``fail_on_leak``, ``HANDLE_THRESHOLD_PER_STEP``; on whether memory is tracked or not (a handle count is
        always measured), off when ``leak_window`` is 0."""
        return cls(warmup_steps=cfg.leak_warmup_steps, window=max(cfg.leak_window, 3),
                   threshold_per_step=HANDLE_THRESHOLD_PER_STEP, fail_on_leak=cfg.fail_on_leak,
                   enabled=cfg.leak_window > 0, where=where, watched=HANDLES)

    def update(self, step: int, allocated_bytes: float,
               breakdown: Mapping[str, int] | None = None) -> LeakVerdict | None:
        """Record the value left at the end of ``step`` (the memory allocated, in bytes, or what ``watched``
        names); returns the verdict once the window is full.

        ``breakdown`` (category -> bytes, e.g. ``MemoryStats.breakdown``) is optional and only names the
        category that grew in the leak message. At the alarm it calls ``on_leak`` and logs the warning (not with
        ``fail_on_leak``: ``check`` then raises the error instead).
        """
        if not self.enabled:
            return None
        self._updates += 1
        if self._updates <= self.warmup_steps:
            return None
        self._points.append((step, allocated_bytes, dict(breakdown or {})))
        if len(self._points) < self.window:
            return None
        steps = [float(s) for s, _, _ in self._points]
        slope = theil_sen_slope(steps, [float(b) for _, b, _ in self._points])
        self._above = self._above + 1 if slope > self.threshold_per_step else 0
        first, last = self._points[0][2], self._points[-1][2]
        growth = {name: last[name] - first.get(name, 0) for name in last}
        verdict = LeakVerdict(step=step, first_step=self._points[0][0], slope_per_step=slope,
                              threshold_per_step=self.threshold_per_step,
                              leaking=self._above >= self.confirm_steps, growth_by_category=growth, where=self.where,
                              watched=self.watched)
        if verdict.leaking and self.alarm is None:
            self._raise_alarm(verdict)
        return verdict

    def _raise_alarm(self, verdict: LeakVerdict) -> None:
        self.alarm = verdict
        if self.on_leak is not None:
            try:
                self.on_leak(verdict)
            except Exception:
                logger.exception("the leak callback failed")
        if self.warn and not self.fail_on_leak:
            logger.warning("%s; see docs/memory.md", verdict.message())

    def check(self) -> None:
        """Raise ``MemoryLeakError`` (one line) if the alarm went off and ``fail_on_leak`` is set."""
        if self.fail_on_leak and self.alarm is not None:
            raise MemoryLeakError(f"{self.alarm.message()}; set memory.fail_on_leak = false to only warn")

    def scalars(self, verdict: LeakVerdict | None) -> dict[str, float]:
        """The tensorboard scalars of ``verdict``: the slope (in ``watched``'s unit) once the window is full, and
        the alarm tag at the alarm's step; empty before."""
        if verdict is None:
            return {}
        scalars = {self.watched.slope_tag: verdict.slope_per_step / self.watched.unit_size}
        if verdict is self.alarm:
            scalars[self.watched.alarm_tag] = 1.0
        return scalars
