"""Check the layout planner (`python -m trainer.plan`) against measured peaks: every layout it lists for the CPU debug
model is trained for a few steps with the exact memory tracker, and its measured worst-rank peak is compared with the
planner's prediction for the worst rank.

`.venv/bin/python benchmarks/plan_check.py [--ngpu 4] [--sample K] [--steps 3] [--batch 2] [--seq 256]
[--routing-skew 1]` prints one JSON object per layout, then a summary object; exits 1 when a layout is outside 10%.
`--sample K` measures K layouts spread over the planner's list (the default measures all of them). The layouts
train in torchrun launches of `CHUNK` jobs each (`benchmarks/memory_plan_check.py` is the worker).

The predicted peak compared is the allocator's (what the exact tracker measures); the comm backend's own buffers
(DeepEP's, outside PyTorch's allocator on GPUs) are reported beside it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.memory_plan_check import BASE, measure_torchrun  # noqa: E402

GiB = 2 ** 30
TOLERANCE = 0.10
CHUNK = 12  # layouts per torchrun launch: rows come out as each launch ends, well within its timeout


def planned(ngpu: int, batch: int, seq: int, steps: int, skew: float) -> tuple[list[dict], list[str]]:
    """The planner's layouts (all of them fit a CPU rank) and the training args they share."""
    from trainer.job_config import load_config
    from trainer.tools.plan import plan_layouts

    shared = BASE + ["--training.local_batch_size", str(batch), "--training.seq_len", str(seq),
                     "--training.steps", str(steps)]
    result = plan_layouts(load_config(shared), ngpu, memory_gib=1000.0, device="cpu", skew=skew)
    return result["layouts"], shared


def layout_args(row: dict) -> list[str]:
    """The command-line overrides of one planned layout."""
    return [x for key, value in row["settings"].items() for x in (f"--{key}", str(value))]


def spread(rows: list[dict]) -> list[dict]:
    """All rows, reordered so that any prefix is spread over the whole list (the planner's order groups alike
    layouts): a run cut short still measures every kind."""
    order, seen = [], set()
    stride = len(rows)
    while stride >= 1:
        for i in range(0, len(rows), stride):
            if i not in seen:
                seen.add(i)
                order.append(i)
        stride //= 2
    return [rows[i] for i in order]


def sample(rows: list[dict], k: int) -> list[dict]:
    """`k` rows spread evenly over the list (first and last included)."""
    if k >= len(rows):
        return rows
    step = (len(rows) - 1) / max(k - 1, 1)
    return [rows[round(i * step)] for i in range(k)]


def check(ngpu: int, k: int | None, batch: int, seq: int, steps: int, skew: float) -> list[dict]:
    """Measure the listed (or `k` sampled) layouts of `ngpu` ranks; print and return one row per layout."""
    rows, shared = planned(ngpu, batch, seq, steps, skew)
    rows = spread(rows) if k is None else sample(rows, k)
    out = []
    t0 = time.perf_counter()
    measured: dict[str, dict] = {}
    for first in range(0, len(rows), CHUNK):
        with tempfile.TemporaryDirectory() as tmp:
            jobs = {f"l{i}": shared[len(BASE):] + layout_args(rows[i])
                    for i in range(first, min(first + CHUNK, len(rows)))}
            measured.update(measure_torchrun(ngpu, jobs, tmp))
        for i in range(first, min(first + CHUNK, len(rows))):
            r, m = rows[i], measured[f"l{i}"]
            predicted = r["allocator_peak_gib"] * GiB
            row = {"ngpu": ngpu, "layout": r["layout"], "predicted_peak_MiB": round(predicted / 2 ** 20, 2),
                   "comm_buffer_MiB": round(r["comm_buffer_gib"] * 1024, 2), "worst_stage": r["worst_stage"],
                   "predicted_phase": r["peak_phase"]}
            if "error" in m:
                row.update(measured_peak_MiB=None, ratio=None, within_10pct=None, training_error=m["error"])
            else:
                ratio = predicted / m["peak_bytes"]
                row.update(measured_peak_MiB=round(m["peak_bytes"] / 2 ** 20, 2), ratio=round(ratio, 4),
                           within_10pct=abs(ratio - 1) <= TOLERANCE,
                           per_rank_measured_MiB=[round(b / 2 ** 20, 2) for b in m["per_rank_peak_bytes"]])
            print(json.dumps(row), flush=True)
            out.append(row)
    wall = time.perf_counter() - t0
    ratios = [r["ratio"] for r in out if r["ratio"] is not None]
    summary = {"summary": True, "ngpu": ngpu, "layouts": len(out), "measured": len(ratios),
               "within_10pct": sum(abs(x - 1) <= TOLERANCE for x in ratios),
               "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
               "errors": sum(r["ratio"] is None for r in out), "wall_s": round(wall, 1)}
    print(json.dumps(summary), flush=True)
    return out


def main(argv: list[str]) -> None:
    """CLI; exits 1 when a measured layout is outside the tolerance or failed to train."""
    def value(flag: str, default: str) -> str:
        return argv[argv.index(flag) + 1] if flag in argv else default

    rows = check(int(value("--ngpu", "4")), int(value("--sample", "0")) or None, int(value("--batch", "2")),
                 int(value("--seq", "256")), int(value("--steps", "3")), float(value("--routing-skew", "1")))
    if any(r["within_10pct"] is not True for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    import logging

    logging.disable(logging.INFO)
    main(sys.argv[1:])
