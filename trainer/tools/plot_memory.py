"""Memory curves of one run of a job as one PNG, with the leak detector's verdicts, readable at 2 or 512 ranks.

    python -m trainer.plot_memory <dump folder | tb folder | run folder> [--run RUN_ID] [--out memory.png]
                                  [--threshold-MiB 0.1] [--window 10] [--warmup 5]

Reads the tensorboard scalars the train loop writes for one run (the latest of the dump or tb folder, the run named
by ``--run``, or the run folder given; runs are never mixed):
  * the run folder (rank 0): the spread of memory over the ranks, ``memory/<field>/{max,min,median}`` and the same
    per pipeline stage (``memory/<field>/stage_<s>/...``), the rank holding each max at each logging step (text,
    ``trainer.memory.ranks.read_worst_ranks``), and the step and rank of a leak alarm;
  * with ``metrics.save_for_all_ranks``, ``rank_<r>/``: every rank's own curves, on which the leak detector is run
    again (with its defaults or the flags), so that a run that did not detect leaks can still be checked.

Three panels: tensor memory (the peak within each step and the memory left at step end), the process RSS or CUDA
reserved bytes, and the leak slope against its threshold. Up to `MAX_RANK_LINES` ranks with their own curves get one
line each; beyond, each pipeline stage is a band from its smallest to its largest rank with its median as a line,
and the rank with the largest peak is drawn on its own and named. The legend sits beside the axes and the verdicts
are summarised above them, one line per distinct verdict, so the figure stays readable at any rank count. A
series of few points (a run of 1 to 20 steps) gets a marker at each point, so a 1-step run is not empty. Needs
matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

from trainer.memory.leak_detector import ALARM_RANK_TAG, ALARM_TAG, SLOPE_TAG, LeakDetector, LeakVerdict
from trainer.memory.ranks import read_worst_ranks
from trainer.metrics import read_hparams, read_scalars, run_dirs

__all__ = ["MAX_RANK_LINES", "RankSeries", "RunMemory", "find_run", "load_run", "main", "render"]

ALLOCATED = "memory/allocated_GiB"
PEAK = "memory/peak_allocated_GiB"
RESERVED = "memory/reserved_GiB"
RSS = "memory/rss_GiB"
_PER_RANK = (ALLOCATED, PEAK, RESERVED, RSS, SLOPE_TAG)
MAX_RANK_LINES = 8
"""Ranks with their own curves drawn one line each; more are drawn as bands per pipeline stage."""
MAX_VERDICT_LINES = 6
"""Distinct verdicts shown; the rest are counted in one last line."""
MARKERS_UP_TO = 20
"""A series of at most this many points is drawn with a marker at each point: a line through one point (a 1-step
run) draws nothing, and a few points are easier to read as dots."""

Series = tuple[list[int], list[float]]


@dataclass
class RankSeries:
    """The memory scalars of one rank as ``{tag: (steps, values)}``, the detector's reading of them, and the step
    at which the run's own detector (with the run's ``memory.leak_*`` settings) raised its alarm, if it did."""

    rank: int
    series: dict[str, Series]
    verdicts: list[LeakVerdict]
    alarm: LeakVerdict | None
    run_alarm_step: int | None = None

    def verdict(self) -> str:
        """The verdict without the rank: the leak alarm (this reading's, else the run's own), or the largest
        slope seen."""
        if self.alarm is not None:
            return self.alarm.message()
        if self.run_alarm_step is not None:
            steps, slopes = self.series.get(SLOPE_TAG, ([], []))
            slope = dict(zip(steps, slopes)).get(self.run_alarm_step)
            rate = f" at {slope:.4g} MiB/step" if slope is not None else ""
            return (f"memory leak: the run's detector raised its alarm at step {self.run_alarm_step}{rate} (with "
                    "the run's memory.leak_* settings)")
        if ALLOCATED not in self.series:
            return "no tensor memory logged (memory tracking was off), no leak verdict"
        if not self.verdicts:
            return "too few steps for the leak detector"
        return f"no leak (largest slope {max(v.slope_MiB_per_step for v in self.verdicts):.4g} MiB/step)"

    def summary(self) -> str:
        """One line: `rank r: <verdict>`."""
        return f"rank {self.rank}: {self.verdict()}"

    @property
    def leaking(self) -> bool:
        return self.alarm is not None or self.run_alarm_step is not None


@dataclass
class RunMemory:
    """One run: every rank's own curves where the run saved them, and the spread over the ranks that rank 0 logged.

    spread: ``{tag: {"max" | "min" | "median" | "max_rank": (steps, values)}}`` for the tags `memory/<field>` and
    `memory/<field>/stage_<s>` (``max_rank``: the rank holding the max, at the logging steps). alarms: (step,
    rank) of the leak alarms rank 0 logged. world_size: from the run's HParams row (None for a run that has none)."""

    run_dir: str
    ranks: list[RankSeries] = field(default_factory=list)
    spread: dict[str, dict[str, Series]] = field(default_factory=dict)
    alarms: list[tuple[int, int]] = field(default_factory=list)
    world_size: int | None = None
    pp: int = 1

    def verdict_lines(self) -> list[str]:
        """The leak verdicts, one line per distinct verdict: `ranks 0-15 (16): no leak (...)`, a line per leaking
        rank, at most `MAX_VERDICT_LINES` lines (the rest counted in the last)."""
        if self.ranks:
            lines = _grouped(self.ranks)
        else:
            lines = [self._spread_verdict()]
        if len(lines) > MAX_VERDICT_LINES:
            lines = lines[:MAX_VERDICT_LINES - 1] + [f"... and {len(lines) - MAX_VERDICT_LINES + 1} more verdicts"]
        return lines

    def _spread_verdict(self) -> str:
        """The verdict from rank 0's spread alone (no rank saved its own curves)."""
        who = f"{self.world_size} ranks" if self.world_size else "every rank"
        if self.alarms:
            step, rank = self.alarms[0]
            return f"rank {rank}: memory leak: the run's detector raised its alarm at step {step}"
        slope = self.spread.get(SLOPE_TAG, {})
        if "max" in slope:
            steps, values = slope["max"]
            top = max(range(len(values)), key=values.__getitem__)
            rank = dict(zip(*slope["max_rank"])).get(steps[top]) if "max_rank" in slope else None  # logging steps
            at = f", rank {rank} at step {steps[top]}" if rank is not None else ""
            return f"{who}: no leak alarm (largest slope {values[top]:.4g} MiB/step{at})"
        if ALLOCATED in self.spread:
            return f"{who}: too few steps for the leak detector"
        return f"{who}: no tensor memory logged (memory tracking was off), no leak verdict"

    def worst_rank(self) -> int | None:
        """The rank most often holding the largest peak over the steps (the largest RSS without tensor memory)."""
        for tag in (PEAK, RSS):
            ranks = self.spread.get(tag, {}).get("max_rank")
            if ranks:
                return Counter(int(r) for r in ranks[1]).most_common(1)[0][0]
        return None


def _ranges(ranks: list[int]) -> str:
    """`0-3, 5, 7-9`."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _grouped(ranks: list[RankSeries]) -> list[str]:
    """Leaking ranks one line each; the others grouped by verdict kind, with the largest slope among them."""
    lines = [run.summary() for run in ranks if run.leaking]
    quiet = [run for run in ranks if not run.leaking]
    kinds: dict[str, list[RankSeries]] = {}
    for run in quiet:  # "no leak" verdicts differ only by their slope: one group
        kinds.setdefault("no leak" if run.verdicts else run.verdict(), []).append(run)
    for kind, group in kinds.items():
        who = f"rank {group[0].rank}" if len(group) == 1 else \
            f"ranks {_ranges([r.rank for r in group])} ({len(group)})"
        slopes = [(max(v.slope_MiB_per_step for v in r.verdicts), r.rank) for r in group if r.verdicts]
        if slopes:
            slope, rank = max(slopes, key=lambda sr: (sr[0], -sr[1]))  # the lowest rank of a tie
            kind += f" (largest slope {slope:.4g} MiB/step" + (f", rank {rank})" if len(group) > 1 else ")")
        lines.append(f"{who}: {kind}")
    return lines


def _rank_dirs(run_dir: str) -> dict[int, str]:
    """Rank -> tensorboard folder of the ranks that saved their own curves (``rank_<r>``)."""
    dirs = {}
    for path in glob.glob(os.path.join(run_dir, "rank_*")):
        match = re.fullmatch(r"rank_(\d+)", os.path.basename(path))
        if match and os.path.isdir(path):
            dirs[int(match.group(1))] = path
    return dict(sorted(dirs.items()))


def _has_events(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "events.out.tfevents.*")))


def find_run(path: str, run: str | None = None) -> str:
    """The run folder to read: the run ``run`` (default: the latest) of ``path/tb`` or of ``path`` as the tb
    folder, else ``path`` itself when it is a run folder (it holds event files or ``rank_<r>`` folders).

    Raises FileNotFoundError with a one-line message naming what was looked for and the runs there are.
    """
    tb = os.path.join(path, "tb") if os.path.isdir(os.path.join(path, "tb")) else path
    runs = run_dirs(tb)
    if not runs:
        if (_rank_dirs(path) or _has_events(path)) and run is None:
            return path
        raise FileNotFoundError(f"no tensorboard runs in {path}: expected a dump folder (with tb/<run id>/), its tb "
                                f"folder or a run folder")
    if run is None:
        return runs[-1]
    names = [os.path.basename(r) for r in runs]
    if run not in names:
        raise FileNotFoundError(f"no run {run} under {tb} (runs: {', '.join(names)})")
    return os.path.join(tb, run)


def _rank_series(rank: int, scalars: dict[str, list[tuple[int, float]]], warmup_steps: int, window: int,
                 threshold_MiB_per_step: float) -> RankSeries:
    """One rank's curves with the leak detector run again on its step-end allocation."""
    series = {tag: ([s for s, _ in points], [v for _, v in points]) for tag, points in scalars.items()
              if tag in _PER_RANK}
    detector = LeakDetector(warmup_steps, window, threshold_MiB_per_step * 2**20, warn=False)
    steps, allocated = series.get(ALLOCATED, ([], []))
    verdicts = [v for step, gib in zip(steps, allocated) if (v := detector.update(step, round(gib * 2**30)))]
    alarm_steps = [step for step, _ in scalars.get(ALARM_TAG, [])]
    return RankSeries(rank, series, verdicts, detector.alarm, alarm_steps[0] if alarm_steps else None)


def load_run(run_dir: str, warmup_steps: int = 5, window: int = 10, threshold_MiB_per_step: float = 0.1) -> RunMemory:
    """The memory of one run (a folder from ``find_run``): the spread rank 0 logged, and every rank's own curves
    where the run saved them. A single-process run's spread is its only rank's curves."""
    dirs = _rank_dirs(run_dir)
    if not dirs and not _has_events(run_dir):
        raise FileNotFoundError(f"no tensorboard event files under {run_dir}")
    result = RunMemory(run_dir)
    if _has_events(run_dir):
        scalars = read_scalars(run_dir)
        hparams = read_hparams(run_dir)
        result.world_size = int(hparams["world_size"]) if "world_size" in hparams else None
        result.pp = int(hparams.get("pp", 1))
        for tag, points in scalars.items():
            base, _, stat = tag.rpartition("/")
            if base.startswith("memory/") and stat in ("max", "min", "median"):
                result.spread.setdefault(base, {})[stat] = ([s for s, _ in points], [v for _, v in points])
        for base, points in read_worst_ranks(run_dir).items():
            if base.startswith("memory/"):
                result.spread.setdefault(base, {})["max_rank"] = ([s for s, _ in points], [r for _, r in points])
        ranks = dict(scalars.get(ALARM_RANK_TAG, []))
        result.alarms = [(step, int(ranks.get(step, 0))) for step, _ in scalars.get(ALARM_TAG, [])]
        if not result.spread and not dirs:  # a run folder of per-rank tags: rank 0's own
            dirs = {0: run_dir}
        elif result.world_size == 1 and not dirs:
            own = {tag: [(s, v) for s, v in zip(*stats["max"])] for tag, stats in result.spread.items()
                   if "max" in stats}
            own[ALARM_TAG] = [(step, 1.0) for step, _ in result.alarms]
            result.ranks.append(_rank_series(0, own, warmup_steps, window, threshold_MiB_per_step))
    for rank, path in dirs.items():
        result.ranks.append(_rank_series(rank, read_scalars(path), warmup_steps, window, threshold_MiB_per_step))
    return result


def _plot(ax, steps: list[int], values: list[float], style: str, **kwargs) -> None:
    """One series as a line, with a marker at each point when it has few (`MARKERS_UP_TO`)."""
    if len(steps) <= MARKERS_UP_TO:
        kwargs.setdefault("marker", "o")
        kwargs.setdefault("markersize", 4)
    ax.plot(steps, values, style, **kwargs)


def _band(ax, stats: dict[str, Series], color: str, label: str, style: str = "-") -> None:
    """min..max filled, the median as a line."""
    if "min" in stats and "max" in stats:
        steps, low = stats["min"]
        ax.fill_between(steps, low, stats["max"][1], color=color, alpha=0.25, linewidth=0)
        if len(steps) <= MARKERS_UP_TO:  # a band over one step has no width: its ends as ticks
            ax.plot(steps + steps, low + stats["max"][1], "_", color=color, markersize=8)
    if "median" in stats:
        _plot(ax, *stats["median"], style, color=color, linewidth=1.2, label=label)


def _groups(run: RunMemory, tag: str) -> list[tuple[str, dict[str, Series]]]:
    """(label, spread) per pipeline stage of `tag`, or of all ranks without stages."""
    stages = sorted((k for k in run.spread if k.startswith(tag + "/stage_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    if stages:
        return [(f"stage {k.rsplit('_', 1)[1]}", run.spread[k]) for k in stages]
    return [("all ranks", run.spread[tag])] if tag in run.spread else []


def render(run: RunMemory, out_path: str, threshold_MiB_per_step: float = 0.1, title: str = "") -> None:
    """Draw ``run`` into a 1400 x 1000 pixel PNG at ``out_path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise SystemExit("trainer.plot_memory needs matplotlib: pip install -e '.[plot]'") from None

    # The object API with the Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(14, 10), dpi=100)
    FigureCanvasAgg(fig)
    lines = run.verdict_lines()
    top = 0.93 - 0.022 * len(lines)  # the title and the verdicts above the axes, never over them
    grid = fig.add_gridspec(3, 1, height_ratios=[3, 2, 2], left=0.07, right=0.74, top=top, bottom=0.06, hspace=0.12)
    ax_mem = fig.add_subplot(grid[0])
    ax_host = fig.add_subplot(grid[1], sharex=ax_mem)
    ax_slope = fig.add_subplot(grid[2], sharex=ax_mem)
    per_rank = bool(run.ranks) and len(run.ranks) <= MAX_RANK_LINES
    if per_rank:
        _draw_ranks(run.ranks, ax_mem, ax_host, ax_slope)
    else:
        _draw_bands(run, ax_mem, ax_host, ax_slope)
    ax_slope.axhline(threshold_MiB_per_step, color="black", linestyle="--", linewidth=1,
                     label=f"threshold {threshold_MiB_per_step:g} MiB/step")
    ax_mem.set_ylabel("tensor memory (GiB)")
    cuda = RESERVED in run.spread or any(RESERVED in r.series for r in run.ranks)
    ax_host.set_ylabel("RSS / CUDA reserved (GiB)" if cuda else "process RSS (GiB)")
    ax_slope.set_ylabel("leak slope (MiB/step)")
    ax_slope.set_xlabel("step")
    ax_slope.xaxis.set_major_locator(MaxNLocator(integer=True))
    low, high = ax_slope.get_xlim()
    if high - low < 2:  # one or two steps: whole steps on the axis, not 0.945 ... 1.050
        middle = round((low + high) / 2)
        ax_slope.set_xlim(middle - 1, middle + 1)
    for ax in (ax_mem, ax_host):
        ax.tick_params(labelbottom=False)  # the panels share the step axis: labelled once, at the bottom
    for ax in (ax_mem, ax_host, ax_slope):
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    fig.text(0.01, 0.985, title, fontsize=11, va="top", ha="left")
    fig.text(0.01, 0.955, "\n".join(lines), fontsize=9, va="top", ha="left", family="monospace")
    fig.savefig(out_path)


def _draw_ranks(ranks: list[RankSeries], ax_mem, ax_host, ax_slope) -> None:
    """One colour per rank (few ranks)."""
    for run, color in zip(ranks, (f"C{i % 10}" for i in range(len(ranks)))):
        label = f"rank {run.rank}"
        for tag, style, what in ((PEAK, "--", "peak"), (ALLOCATED, "-", "step end")):
            if tag in run.series:
                _plot(ax_mem, *run.series[tag], style, color=color, label=f"{label} {what}")
        if RSS in run.series:
            _plot(ax_host, *run.series[RSS], "-", color=color, label=f"{label} RSS")
        if RESERVED in run.series:
            _plot(ax_host, *run.series[RESERVED], "--", color=color, label=f"{label} CUDA reserved")
        if SLOPE_TAG in run.series:
            _plot(ax_slope, *run.series[SLOPE_TAG], "-", color=color, label=f"{label} (logged)")
        elif run.verdicts:
            _plot(ax_slope, [v.step for v in run.verdicts], [v.slope_MiB_per_step for v in run.verdicts], "-",
                  color=color, label=f"{label} (recomputed)")
        if run.alarm is not None:
            for ax in (ax_mem, ax_slope):
                ax.axvline(run.alarm.step, color=color, linestyle=":", linewidth=1.5)
            steps, values = run.series[ALLOCATED]
            ax_mem.annotate(f"leak: {run.alarm.slope_MiB_per_step:.3g} MiB/step", xy=(run.alarm.step,
                            values[steps.index(run.alarm.step)]), xytext=(15, 25), textcoords="offset points",
                            color=color, fontsize=10, arrowprops=dict(arrowstyle="->", color=color))


def _draw_bands(run: RunMemory, ax_mem, ax_host, ax_slope) -> None:
    """Bands per pipeline stage (many ranks, or only rank 0's spread), and the worst rank on its own."""
    for i, (name, stats) in enumerate(_groups(run, PEAK)):
        _band(ax_mem, stats, f"C{i}", f"{name}: peak, median and min-max")
    for i, (name, stats) in enumerate(_groups(run, ALLOCATED)):
        _band(ax_mem, stats, f"C{i}", f"{name}: step end, median and min-max", style=":")
    for tag, what in ((RSS, "RSS"), (RESERVED, "CUDA reserved")):
        for i, (name, stats) in enumerate(_groups(run, tag)):
            _band(ax_host, stats, f"C{i}", f"{name}: {what}, median and min-max")
    worst = run.worst_rank()
    own = next((r for r in run.ranks if r.rank == worst), None)
    if own is not None and PEAK in own.series:
        _plot(ax_mem, *own.series[PEAK], "-", color="black", linewidth=1.5, label=f"rank {worst} (largest peak)")
    elif PEAK in run.spread and "max" in run.spread[PEAK]:
        _plot(ax_mem, *run.spread[PEAK]["max"], "-", color="black", linewidth=1.5,
              label=f"largest peak (mostly rank {worst})")
    slope = run.spread.get(SLOPE_TAG, {})
    if "max" in slope:
        _plot(ax_slope, *slope["max"], "-", color="C3", label="largest over the ranks")
    elif run.ranks:
        leaking = [r for r in run.ranks if r.leaking][:MAX_RANK_LINES]
        for r in leaking:
            _plot(ax_slope, [v.step for v in r.verdicts], [v.slope_MiB_per_step for v in r.verdicts], "-",
                  label=f"rank {r.rank} (recomputed)")
    for step, rank in run.alarms[:1]:
        for ax in (ax_mem, ax_slope):
            ax.axvline(step, color="C3", linestyle=":", linewidth=1.5, label=f"leak alarm, rank {rank}")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; prints the run it read, its verdict lines and the path of the PNG."""
    parser = argparse.ArgumentParser(prog="python -m trainer.plot_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the job's job.dump_folder, its tb folder, or one run folder in it")
    parser.add_argument("--run", help="run id (a folder name in tb/) to read instead of the latest run")
    parser.add_argument("--out", help="PNG to write (default: memory.png in the run folder)")
    parser.add_argument("--threshold-MiB", type=float, default=0.1, help="leak threshold in MiB/step")
    parser.add_argument("--window", type=int, default=10, help="leak detector window in steps")
    parser.add_argument("--warmup", type=int, default=5, help="leak detector warm-up steps")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run_dir = find_run(args.path, args.run)
        run = load_run(run_dir, args.warmup, args.window, args.threshold_MiB)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    out = args.out or os.path.join(run_dir, "memory.png")
    render(run, out, args.threshold_MiB, title=f"memory of run {os.path.basename(os.path.abspath(run_dir))}")
    print(f"run {run_dir}")
    for line in run.verdict_lines():
        print(line)
    print(f"wrote {out}")


def cli() -> None:
    """The command line (argparse reads sys.argv)."""
    main()
