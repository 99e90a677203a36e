"""Pieces shared by the benchmark scripts."""

from __future__ import annotations

import os


def machine_info() -> dict:
    """CPU model, cores, torch threads and version, and the load average now (other processes on a 2-core machine
    make every timing slower and noisier, so reports carry it)."""
    import torch

    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "load_average_before": os.getloadavg()}


def labelled(name: str, fn):
    """`fn` running inside a profiler label (a no-op when no profiler is active)."""
    from torch.profiler import record_function

    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper
