"""Context parallelism: step time and peak memory per rank for each sequence length and cp degree, beside the
memory plan's prediction; one JSON object per row, then a summary with the ratios measured in this run.

`.venv/bin/python benchmarks/context_parallel.py [--seqs 4096,8192] [--cps 1,2,4] [--layers 2] [--steps 3]
[--ac none] [--dtype float32] [--memory-gib G]`

Each row trains the debug model (cut to `--layers` blocks: one dense, the rest MoE) on `cp` ranks with one sequence
per step (`local_batch_size` 1, `context_parallel_degree` cp), with the exact memory tracker: the peak and the
activations at the peak are the allocator's, the largest over the ranks, each beside the plan's (the activation
peak planned is the forward-backward peak beyond weights and optimizer state: activations held, the backward's
working set); the step time is the median over the steps after the first of the slowest rank's (tokens per rank /
its tokens/s), measured with the tracker on, with one thread per rank (on a 2-core machine cp = 2 uses both
cores where cp = 1 uses one: CPU step times say nothing about GPUs). A
row whose planned peak exceeds `--memory-gib` per rank (default: this host's memory over the ranks, less 10%) is
not run; its JSON says why.

On CPU the ranks are gloo processes. On a GPU node the same command runs each row on `cp` GPUs over NCCL; rows
with more ranks than the node has GPUs are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.memory_plan_check import measure_torchrun, predict  # noqa: E402

MiB = 2 ** 20


def row_args(seq: int, cp: int, layers: int, steps: int, ac: str, dtype: str) -> list[str]:
    """Config overrides of one row."""
    return ["--model.n_layers", str(layers), "--training.seq_len", str(seq), "--training.local_batch_size", "1",
            "--training.steps", str(steps), "--parallelism.context_parallel_degree", str(cp),
            "--activation_checkpoint.mode", ac, "--training.dtype", dtype]


def _memory_per_rank_gib(ranks: int) -> float:
    from trainer import device as devices

    return devices.memory_per_rank_bytes(ranks) * 0.9 / 2 ** 30


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_row(seq: int, cp: int, layers: int, steps: int, ac: str, dtype: str, memory_gib: float | None,
            tmp: str) -> dict:
    """Plan, then (when it fits) measure one row."""
    args = row_args(seq, cp, layers, steps, ac, dtype)
    row = {"seq_len": seq, "cp": cp, "layers": layers, "ac": ac, "dtype": dtype, "steps": steps}
    gpus = _gpus()
    planned = predict(cp, args, "cuda" if gpus else "cpu")
    row["predicted_peak_MiB"] = round(planned["predicted_peak_bytes"] / MiB, 1)
    # the plan's forward-backward peak beyond the weights and optimizer state: activations held, the backward's
    # working set, gathered units; what the exact tracker counts as activations at the peak
    row["predicted_activation_peak_MiB"] = round(planned["forward_backward_peak_bytes"] / MiB, 1)
    budget = memory_gib if memory_gib is not None else _memory_per_rank_gib(cp)
    if gpus and cp > gpus:
        return {**row, "skipped": f"needs {cp} GPUs, this node has {gpus}"}
    if planned["predicted_peak_bytes"] > budget * 2 ** 30:
        return {**row, "skipped": f"planned peak {planned['predicted_peak_bytes'] / 2 ** 30:.1f} GiB per rank > "
                                  f"{budget:.1f} GiB available"}
    t0 = time.perf_counter()
    measured = measure_torchrun(cp, {"row": args}, tmp)["row"]
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    if "error" in measured:
        return {**row, "training_error": measured["error"]}
    later = measured["tokens_per_s"][1:] or measured["tokens_per_s"]
    row.update({
        "step_s": round(seq / cp / statistics.median(later), 3),
        "measured_peak_MiB": round(measured["peak_bytes"] / MiB, 1),
        "per_rank_peak_MiB": [round(b / MiB, 1) for b in measured["per_rank_peak_bytes"]],
        "activations_at_peak_MiB": round(measured["activations_at_peak_bytes"] / MiB, 1),
        "plan_over_measured": round(planned["predicted_peak_bytes"] / measured["peak_bytes"], 4),
        "activations_plan_over_measured": round(planned["forward_backward_peak_bytes"] /
                                                measured["activations_at_peak_bytes"], 4),
    })
    return row


def main(argv: list[str]) -> None:
    def value(flag: str, default: str) -> str:
        return argv[argv.index(flag) + 1] if flag in argv else default

    seqs = [int(s) for s in value("--seqs", "4096,8192").split(",")]
    cps = [int(c) for c in value("--cps", "1,2,4").split(",")]
    layers, steps = int(value("--layers", "2")), int(value("--steps", "3"))
    ac, dtype = value("--ac", "none"), value("--dtype", "float32")
    memory_gib = float(value("--memory-gib", "0")) or None
    print(json.dumps({"machine": machine_info()}), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqs:
            for cp in cps:
                row = run_row(seq, cp, layers, steps, ac, dtype, memory_gib, tmp)
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary: dict = {"summary": True}
    for seq in seqs:
        base = next((r for r in rows if r["seq_len"] == seq and r["cp"] == 1 and "measured_peak_MiB" in r), None)
        for r in rows:
            if r["seq_len"] != seq or r["cp"] == 1 or "measured_peak_MiB" not in r or base is None:
                continue
            summary[f"seq{seq}_cp{r['cp']}_activations_over_cp1"] = round(
                r["activations_at_peak_MiB"] / base["activations_at_peak_MiB"], 4)
            summary[f"seq{seq}_cp{r['cp']}_peak_over_cp1"] = round(r["measured_peak_MiB"] / base["measured_peak_MiB"], 4)
            summary[f"seq{seq}_cp{r['cp']}_step_time_over_cp1"] = round(r["step_s"] / base["step_s"], 4)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
