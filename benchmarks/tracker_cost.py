"""What the exact memory tracker costs per training step on CPU, and what its peak update saves over stock MemTracker's.

    .venv/bin/python benchmarks/tracker_cost.py [--steps 8] [--mlp-steps 30]

Three ways of tracking, measured in one run:

* ``off``: no tensor tracking (``memory.track = "off"``);
* ``exact``: the trainer's exact tracker (``trainer/memory/tracker.py``), which updates the peaks of the modules
  that are running only;
* ``exact_stock_peaks``: the same tracker with stock ``MemTracker._update_peak_stats``, which loops over every module
  seen in the step after every op (what the trainer ran before 2026-11-27).

Two workloads: an MLP training step (3 linear layers, batch 64, AdamW; hidden width 64 and 1024, where the per-op
cost dominates or not), median step time over ``--mlp-steps``; and the debug model (``train_configs/debug_model.toml``,
one process, fp32, batch 2 x 256, AC none and selective) through the trainer, the median of each step's
tokens/s after the first. Prints one JSON object per row, then a summary object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.memory_plan_check import BASE  # noqa: E402

MODES = ("off", "exact", "exact_stock_peaks")


def _stock_tracker_class() -> type:
    """The trainer's tracker with stock MemTracker's peak update (a loop over every module seen this step)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainer.memory.tracker import _StepMemTracker

    class StockPeaks(_StepMemTracker):
        _update_peak_stats = MemTracker._update_peak_stats

    return StockPeaks


class _tracker_class:
    """Within the block, ``MemoryMonitor`` builds its exact tracker from the class of ``mode``."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        import trainer.memory.monitor as monitor

        self._saved = monitor._StepMemTracker
        if self.mode == "exact_stock_peaks":
            monitor._StepMemTracker = _stock_tracker_class()

    def __exit__(self, *exc: object) -> None:
        import trainer.memory.monitor as monitor

        monitor._StepMemTracker = self._saved


def mlp_step_ms(width: int, mode: str, steps: int) -> float:
    """Median time of one MLP training step (forward, backward, AdamW) under `mode`, in ms."""
    from trainer.memory.monitor import MemoryMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _tracker_class(mode):
        monitor = MemoryMonitor("cpu", mode="off" if mode == "off" else "exact")
    monitor.track(model, optimizer)
    times = []
    with monitor:
        for _ in range(steps + 2):
            start = time.perf_counter()
            model(torch.randn(64, width)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step_end()
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def debug_model_tokens_per_s(ac: str, mode: str, steps: int) -> tuple[float, list]:
    """Median tokens/s of the debug model's steps after the first under `mode`, and each step's peak (GiB)."""
    from trainer.job_config import load_config
    from trainer.train import run

    with tempfile.TemporaryDirectory() as dump, _tracker_class(mode):
        args = BASE + ["--training.steps", str(steps), "--training.local_batch_size", "2", "--training.seq_len",
                       "256", "--activation_checkpoint.mode", ac, "--metrics.log_freq", "1", "--job.dump_folder",
                       dump, "--memory.track", "off" if mode == "off" else "exact"]
        history: list[dict] = []
        run(load_config(args), shutdown=False, history=history)
    rates = [h["throughput/rank_tokens_per_s"] for h in history[1:]]
    return statistics.median(rates), [h.get("memory/peak_allocated_GiB") for h in history]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="debug-model steps per run (the first is not timed)")
    parser.add_argument("--mlp-steps", type=int, default=30, help="timed MLP steps per row")
    args = parser.parse_args(argv)
    logging.disable(logging.INFO)
    torch.set_num_threads(1)
    summary: dict = {"summary": True, "machine": machine_info(), "torch": torch.__version__}
    for width in (64, 1024):
        row = {"workload": f"mlp_width_{width}", **{f"{m}_step_ms": round(mlp_step_ms(width, m, args.mlp_steps), 3)
                                                     for m in MODES}}
        print(json.dumps(row), flush=True)
        summary[f"mlp_width_{width}_exact_over_off"] = round(row["exact_step_ms"] / row["off_step_ms"], 2)
        summary[f"mlp_width_{width}_stock_over_exact"] = round(row["exact_stock_peaks_step_ms"]
                                                               / row["exact_step_ms"], 2)
    for ac in ("none", "selective"):
        row: dict = {"workload": f"debug_model_ac_{ac}"}
        peaks = {}
        for mode in MODES:
            rate, peaks[mode] = debug_model_tokens_per_s(ac, mode, args.steps)
            row[f"{mode}_tokens_per_s"] = round(rate, 1)
        row["same_peaks"] = peaks["exact"] == peaks["exact_stock_peaks"]
        print(json.dumps(row), flush=True)
        summary[f"debug_{ac}_off_over_exact"] = round(row["off_tokens_per_s"] / row["exact_tokens_per_s"], 2)
        summary[f"debug_{ac}_exact_over_stock"] = round(row["exact_tokens_per_s"]
                                                        / row["exact_stock_peaks_tokens_per_s"], 2)
        summary[f"debug_{ac}_same_peaks"] = row["same_peaks"]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
