"""The throughput benchmarks' reports: `benchmarks/throughput.py --smoke` (one process) and
`benchmarks/scaling.py --smoke` (independent processes, then throughput.py on 2 gloo ranks with EP 2) run and print
the documented schema.

Only keys and types are checked, never timings or ratios: the numbers depend on the machine and on what else runs
on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MACHINE_KEYS = {"cpu", "cores", "torch_threads", "torch", "load_average_before", "load_average_after"}


def _run_json(script: str, timeout: float) -> dict:
    r = subprocess.run([sys.executable, script, "--smoke"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)  # stdout holds exactly one JSON object


def check_throughput_report(report: dict, world_size: int, ep: int, memory_track: str) -> None:
    """The schema of one throughput.py --smoke report (of rank 0 under torchrun)."""
    assert set(report) == {"machine", "config", "tokens_per_s", "aggregate_tokens_per_s", "rank_step_time_s",
                           "step_time_s", "model_tflops", "peak_tflops", "mfu", "peak_memory_bytes", "time_split_s",
                           "time_split_share", "time_budget", "top_ops"}
    assert MACHINE_KEYS <= set(report["machine"])
    config = report["config"]
    assert config["single_process"] is (world_size == 1)
    assert config["world_size"] == world_size
    assert config["parallel_degrees"] == {"dp_replicate": 1, "dp_shard": world_size, "ep": ep, "pp": 1}
    assert (config["steps"], config["warmup"], config["batch"], config["seq_len"]) == (2, 1, 2, 32)
    assert config["memory_track"] == memory_track
    for key in ("tokens_per_s", "aggregate_tokens_per_s", "model_tflops", "peak_tflops", "mfu"):
        assert isinstance(report[key], float) and report[key] > 0, key
    steps = report["step_time_s"]
    assert set(steps) == {"median", "min", "max", "all"} and len(steps["all"]) == 2
    assert all(isinstance(t, float) for t in steps["all"])
    ranks = report["rank_step_time_s"]
    assert len(ranks) == world_size and all(isinstance(t, float) for t in ranks)
    assert ranks[0] == steps["median"]  # rank 0's own median comes first
    phases = {"data", "forward", "backward", "optimizer", "communication", "other"}
    assert set(report["time_split_s"]) == phases == set(report["time_split_share"])
    assert all(isinstance(v, float) and v >= 0 for v in report["time_split_s"].values())
    assert report["time_split_s"]["forward"] > 0 and report["time_split_s"]["backward"] > 0
    assert abs(sum(report["time_split_share"].values()) - 1) < 1e-6
    assert report["top_ops"] and all(set(op) == {"name", "self_cpu_ms", "count"} for op in report["top_ops"])
    budget = report["time_budget"]
    assert set(budget) == {"matmul", "attention", "rest_s", "step_at_peak_s", "profiled_step_s"}
    for kind in ("matmul", "attention"):
        assert set(budget[kind]) == {"measured_s", "at_peak_s", "efficiency"}
        assert budget[kind]["measured_s"] > 0 and budget[kind]["at_peak_s"] > 0, kind
    assert budget["step_at_peak_s"] == pytest.approx(budget["matmul"]["at_peak_s"] + budget["attention"]["at_peak_s"])
    assert 0 <= budget["rest_s"] < budget["profiled_step_s"]


def test_smoke_report_schema():
    report = _run_json("benchmarks/throughput.py", timeout=120)
    check_throughput_report(report, world_size=1, ep=1, memory_track="exact")
    assert report["aggregate_tokens_per_s"] == report["tokens_per_s"]  # one process: the job is this rank
    # the smoke run tracks memory exactly, so the trainer's peak is reported
    assert isinstance(report["peak_memory_bytes"], int) and report["peak_memory_bytes"] > 0
    assert report["time_split_s"]["communication"] == 0.0  # one process: no collectives


@pytest.mark.slow
def test_scaling_smoke_report_schema():
    """One torchrun launch (2 ranks, EP 2) after 2 concurrent single-process runs."""
    report = _run_json("benchmarks/scaling.py", timeout=300)
    assert set(report) == {"machine", "config", "independent", "expert_parallel", "ratio"}
    assert MACHINE_KEYS <= set(report["machine"])
    assert report["config"]["nproc"] == 2 and report["config"]["memory_track"] == "off"
    assert {"model", "dtype", "batch", "seq_len", "steps", "warmup", "threads_per_process", "args"} <= set(
        report["config"])
    independent, ep = report["independent"], report["expert_parallel"]
    assert set(independent) == {"aggregate_tokens_per_s", "tokens_per_s", "step_time_s", "reports"}
    assert len(independent["tokens_per_s"]) == len(independent["step_time_s"]) == len(independent["reports"]) == 2
    for run in independent["reports"]:
        check_throughput_report(run, world_size=1, ep=1, memory_track="off")
        assert run["time_split_s"]["communication"] == 0.0
    assert set(ep) == {"aggregate_tokens_per_s", "tokens_per_s", "step_time_s", "communication_s",
                       "communication_share", "report"}
    check_throughput_report(ep["report"], world_size=2, ep=2, memory_track="off")
    assert ep["report"]["peak_memory_bytes"] is None  # memory.track off
    assert len(ep["step_time_s"]) == 2
    # the EP all-to-all and FSDP collectives are seen by the profiler (a schema check: any time > 0)
    assert ep["communication_s"] > 0 and 0 < ep["communication_share"] < 1
    assert all(isinstance(v, float) for v in (independent["aggregate_tokens_per_s"], ep["aggregate_tokens_per_s"],
                                              ep["tokens_per_s"], report["ratio"]))
