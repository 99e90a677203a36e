"""Memory curves of one run of a job as one PNG, with the leak detector's verdict per rank.

    python -m trainer.plot_memory <dump folder | tb folder | run folder> [--run RUN_ID] [--out memory.png]
                                  [--threshold-MiB 0.1] [--window 10] [--warmup 5]

Reads the tensorboard scalars the train loop writes for one run (``<dump>/tb/<run id>`` from rank 0, or
``<dump>/tb/<run id>/rank_<r>`` from every rank with ``metrics.save_for_all_ranks``): the latest run of the dump or
tb folder, the run named by ``--run``, or the run folder given. Runs are never mixed. It draws three panels, one
colour per rank:
  1. memory allocated at step end (solid) and the peak within each step (dashed), with a marker where the leak
     detector raises its alarm;
  2. the process RSS (host memory, solid) and, on CUDA, the caching allocator's reserved bytes (dashed);
  3. the leak slope in MiB/step (logged as ``memory/leak_slope_MiB_per_step``, or recomputed from the
     allocated curve when the run did not log it) against the threshold.
The verdict is recomputed from the allocated curve with the detector's defaults (or the flags), so a run that
did not detect leaks can still be checked. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from dataclasses import dataclass

from trainer.memory.leak_detector import ALARM_TAG, SLOPE_TAG, LeakDetector, LeakVerdict
from trainer.metrics import read_scalars, run_dirs

__all__ = ["RankSeries", "find_run", "load_runs", "main", "render"]

ALLOCATED = "memory/allocated_GiB"
PEAK = "memory/peak_allocated_GiB"
RESERVED = "memory/reserved_GiB"
RSS = "memory/rss_GiB"
_MiB_PER_GiB = 1024.0


@dataclass
class RankSeries:
    """The memory scalars of one rank as ``{tag: (steps, values)}``, the detector's reading of them, and the step
    at which the run's own detector (with the run's ``memory.leak_*`` settings) raised its alarm, if it did."""

    rank: int
    series: dict[str, tuple[list[int], list[float]]]
    verdicts: list[LeakVerdict]
    alarm: LeakVerdict | None
    run_alarm_step: int | None = None

    def summary(self) -> str:
        """One line: the leak alarm (this reading's, else the run's own), or the largest slope seen."""
        if self.alarm is not None:
            return f"rank {self.rank}: {self.alarm.message()}"
        if self.run_alarm_step is not None:
            steps, slopes = self.series.get(SLOPE_TAG, ([], []))
            slope = dict(zip(steps, slopes)).get(self.run_alarm_step)
            rate = f" at {slope:.4g} MiB/step" if slope is not None else ""
            return (f"rank {self.rank}: memory leak: the run's detector raised its alarm at step "
                    f"{self.run_alarm_step}{rate} (with the run's memory.leak_* settings)")
        if ALLOCATED not in self.series:
            return f"rank {self.rank}: no tensor memory logged (memory tracking was off), no leak verdict"
        if not self.verdicts:
            return f"rank {self.rank}: too few steps for the leak detector"
        worst = max(v.slope_MiB_per_step for v in self.verdicts)
        return f"rank {self.rank}: no leak (largest slope {worst:.4g} MiB/step)"


def _rank_dirs(run_dir: str) -> dict[int, str]:
    """Rank -> tensorboard folder of one run: its ``rank_<r>`` folders when present, else the run folder itself."""
    dirs = {}
    for path in glob.glob(os.path.join(run_dir, "rank_*")):
        match = re.fullmatch(r"rank_(\d+)", os.path.basename(path))
        if match and os.path.isdir(path):
            dirs[int(match.group(1))] = path
    if not dirs and glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        dirs[0] = run_dir
    return dict(sorted(dirs.items()))


def find_run(path: str, run: str | None = None) -> str:
    """The run folder to read: the run ``run`` (default: the latest) of ``path/tb`` or of ``path`` as the tb
    folder, else ``path`` itself when it is a run folder (it holds event files or ``rank_<r>`` folders).

    Raises FileNotFoundError with a one-line message naming what was looked for and the runs there are.
    """
    tb = os.path.join(path, "tb") if os.path.isdir(os.path.join(path, "tb")) else path
    runs = run_dirs(tb)
    if not runs:
        if _rank_dirs(path) and run is None:
            return path
        raise FileNotFoundError(f"no tensorboard runs in {path}: expected a dump folder (with tb/<run id>/), its tb "
                                f"folder or a run folder")
    if run is None:
        return runs[-1]
    names = [os.path.basename(r) for r in runs]
    if run not in names:
        raise FileNotFoundError(f"no run {run} under {tb} (runs: {', '.join(names)})")
    return os.path.join(tb, run)


def load_runs(run_dir: str, warmup_steps: int = 5, window: int = 10,
              threshold_MiB_per_step: float = 0.1) -> list[RankSeries]:
    """The memory scalars of every rank of one run (a folder from ``find_run``), each with the leak detector
    re-run on its allocated curve."""
    dirs = _rank_dirs(run_dir)
    if not dirs:
        raise FileNotFoundError(f"no tensorboard event files under {run_dir}")
    runs = []
    for rank, path in dirs.items():
        scalars = read_scalars(path)
        series = {tag: ([s for s, _ in points], [v for _, v in points])
                  for tag, points in scalars.items() if tag in (ALLOCATED, PEAK, RESERVED, RSS, SLOPE_TAG)}
        detector = LeakDetector(warmup_steps, window, threshold_MiB_per_step * 2**20, warn=False)
        steps, allocated = series.get(ALLOCATED, ([], []))
        verdicts = [v for step, gib in zip(steps, allocated) if (v := detector.update(step, round(gib * 2**30)))]
        alarm_steps = [step for step, _ in scalars.get(ALARM_TAG, [])]
        runs.append(RankSeries(rank, series, verdicts, detector.alarm, alarm_steps[0] if alarm_steps else None))
    return runs


def render(runs: list[RankSeries], out_path: str, threshold_MiB_per_step: float = 0.1, title: str = "") -> None:
    """Draw ``runs`` into a 1200 x 1000 pixel PNG at ``out_path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("trainer.plot_memory needs matplotlib: pip install -e '.[plot]'") from None

    # The object API with the Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(12, 10), dpi=100)
    FigureCanvasAgg(fig)
    ax_alloc, ax_reserved, ax_slope = fig.subplots(3, 1, sharex=True, height_ratios=[3, 2, 2])
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors):
        label = f"rank {run.rank}"
        for tag, style, what in ((ALLOCATED, "-", "allocated at step end"), (PEAK, "--", "peak within step")):
            if tag in run.series:
                ax_alloc.plot(*run.series[tag], style, color=color, label=f"{label} {what}")
        if RSS in run.series:
            ax_reserved.plot(*run.series[RSS], "-", color=color, label=f"{label} RSS")
        if RESERVED in run.series:
            ax_reserved.plot(*run.series[RESERVED], "--", color=color, label=f"{label} CUDA reserved")
        if SLOPE_TAG in run.series:
            ax_slope.plot(*run.series[SLOPE_TAG], "-", color=color, label=f"{label} (logged)")
        elif run.verdicts:
            ax_slope.plot([v.step for v in run.verdicts], [v.slope_MiB_per_step for v in run.verdicts], "-",
                          color=color, label=f"{label} (recomputed)")
        if run.alarm is not None:
            for ax in (ax_alloc, ax_slope):
                ax.axvline(run.alarm.step, color=color, linestyle=":", linewidth=1.5)
            steps, values = run.series[ALLOCATED]
            at = values[steps.index(run.alarm.step)]
            ax_alloc.annotate(f"leak: {run.alarm.slope_MiB_per_step:.3g} MiB/step\n"
                              f"(steps {run.alarm.first_step}-{run.alarm.step})",
                              xy=(run.alarm.step, at), xytext=(15, 25), textcoords="offset points",
                              color=color, fontsize=10, arrowprops=dict(arrowstyle="->", color=color))
    ax_slope.axhline(threshold_MiB_per_step, color="black", linestyle="--", linewidth=1,
                     label=f"threshold {threshold_MiB_per_step:g} MiB/step")
    ax_alloc.set_ylabel("tensor memory (GiB)")
    # CUDA runs log the allocator's reserved bytes beside RSS; CPU runs log RSS only
    cuda_reserved = any(RESERVED in run.series for run in runs)
    ax_reserved.set_ylabel("RSS / CUDA reserved (GiB)" if cuda_reserved else "process RSS (GiB)")
    ax_slope.set_ylabel("leak slope (MiB/step)")
    ax_slope.set_xlabel("step")
    for ax in (ax_alloc, ax_reserved, ax_slope):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    verdict_lines = "\n".join(run.summary() for run in runs)
    fig.suptitle((title + "\n" if title else "") + verdict_lines, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(out_path)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; prints the run it read, one verdict line per rank and the path of the PNG."""
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
        runs = load_runs(run_dir, args.warmup, args.window, args.threshold_MiB)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    out = args.out or os.path.join(run_dir, "memory.png")
    render(runs, out, args.threshold_MiB, title=f"memory of run {os.path.abspath(run_dir)}")
    print(f"run {run_dir}")
    for run in runs:
        print(run.summary())
    print(f"wrote {out}")


def cli() -> None:
    """The command line (argparse reads sys.argv)."""
    main()
