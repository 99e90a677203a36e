"""The throughput benchmark's report: `benchmarks/throughput.py --smoke` runs and prints the documented schema.

Only keys and types are checked, never timings: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_smoke_report_schema():
    r = subprocess.run([sys.executable, "benchmarks/throughput.py", "--smoke"], cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)  # stdout holds exactly one JSON object

    assert set(report) == {"machine", "config", "tokens_per_s", "step_time_s", "model_tflops", "peak_tflops", "mfu",
                           "peak_memory_bytes", "time_split_s", "time_split_share", "top_ops"}
    assert {"cpu", "cores", "torch_threads", "torch", "load_average_before", "load_average_after"} <= set(
        report["machine"])
    config = report["config"]
    assert config["single_process"] is True
    assert (config["steps"], config["warmup"], config["batch"], config["seq_len"]) == (2, 1, 2, 32)
    assert config["memory_track"] == "exact"
    for key in ("tokens_per_s", "model_tflops", "peak_tflops", "mfu"):
        assert isinstance(report[key], float) and report[key] > 0, key
    steps = report["step_time_s"]
    assert set(steps) == {"median", "min", "max", "all"} and len(steps["all"]) == 2
    assert all(isinstance(t, float) for t in steps["all"])
    # the smoke run tracks memory exactly, so the trainer's peak is reported
    assert isinstance(report["peak_memory_bytes"], int) and report["peak_memory_bytes"] > 0
    phases = {"data", "forward", "backward", "optimizer", "communication", "other"}
    assert set(report["time_split_s"]) == phases == set(report["time_split_share"])
    assert all(isinstance(v, float) and v >= 0 for v in report["time_split_s"].values())
    assert report["time_split_s"]["communication"] == 0.0  # one process: no collectives
    assert report["time_split_s"]["forward"] > 0 and report["time_split_s"]["backward"] > 0
    assert abs(sum(report["time_split_share"].values()) - 1) < 1e-6
    assert report["top_ops"] and all(set(op) == {"name", "self_cpu_ms", "count"} for op in report["top_ops"])
