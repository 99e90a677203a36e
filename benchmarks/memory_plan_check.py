"""Check `trainer.memory_plan` against measured peaks of the CPU debug model.

`.venv/bin/python benchmarks/memory_plan_check.py [--smoke] [--steps N] [--fp8 RECIPE] [--dtype DTYPE]` prints one
JSON object per row:
the predicted peak of rank 0 (`python -m trainer.memory_plan`), the measured peak (the largest
`memory/peak_allocated_GiB` over all steps and all ranks, exact tracking, i.e. `MemoryMonitor` on CPU) and their
ratio. Rows: 1, 2 and 4 ranks (2 and 4 under torchrun with FSDP and expert parallelism over all ranks) x AC none,
full and selective. `--smoke` runs one row (1 rank, AC none, 2 steps, batch 2 x 128) for CI. `--fp8 blockwise` (or
rowwise) trains every row with that `fp8.recipe`, `--dtype bfloat16` in bf16 (default: the config's fp32).
`--ngpu N --ep E` runs the one layout FSDP N x EP E instead (E < N: each rank's experts FSDP-sharded over N / E ranks).
Each row also gives the activations at the measured peak (the exact tracker's breakdown, all ranks' largest) and the
plan's activations held after forward.

Under torchrun the script is its own worker: `--worker jobs.json out_dir` trains every job in one process group
and writes each rank's peaks to `out_dir/<job>.rank<r>.json`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import help_or_worker, torchrun_jobs  # noqa: E402

GiB = 2 ** 30
TOLERANCE = 0.15
BASE = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"), "--memory.track", "exact",
        "--metrics.enable_tensorboard", "false", "--validation.enable", "false", "--checkpoint.enable", "false",
        "--metrics.log_freq", "1000"]


def row_args(ngpu: int, ac: str, batch: int, seq: int, steps: int, recipe: str = "none",
             dtype: str = "float32", ep: int | None = None) -> list[str]:
    """Config overrides of one row: FSDP over all ranks and EP over `ep` ranks (default: all) when there are
    several."""
    args = ["--training.local_batch_size", str(batch), "--training.seq_len", str(seq), "--training.steps", str(steps),
            "--activation_checkpoint.mode", ac, "--fp8.recipe", recipe, "--training.dtype", dtype]
    if ngpu > 1:
        args += ["--parallelism.data_parallel_shard_degree", str(ngpu),
                 "--parallelism.expert_parallel_degree", str(ep or ngpu)]
    return args


def predict(ngpu: int, args: list[str], device: str = "cpu") -> dict:
    """Rank 0's plan (all ranks of this layout hold the same shares; routing is assumed balanced)."""
    from trainer.job_config import load_config
    from trainer.tools.memory_plan import plan

    return plan(load_config(BASE + args), ngpu, device)["ranks"][0]


RATE = "throughput/rank_tokens_per_s"
"""This rank's tokens/s over the steps since the last logging step (logged at logging steps only)."""


def _peaks(history: list[dict]) -> dict:
    peaks = [h["memory/peak_allocated_GiB"] * GiB for h in history]
    top = max(range(len(history)), key=lambda i: peaks[i])
    return {"peak_bytes": int(round(peaks[top])), "per_step_peak_bytes": [int(round(p)) for p in peaks],
            "activations_at_peak_bytes": int(round(history[top]["memory/peak_breakdown/activations_GiB"] * GiB)),
            "tokens_per_s": [h[RATE] for h in history if RATE in h]}  # logging steps only


def measure_in_process(args: list[str], dump: str) -> dict:
    """Train one row in this process (one rank, no process group) and return its peaks."""
    import torch

    from trainer.job_config import load_config
    from trainer.train import Trainer, prepare

    torch.set_num_threads(1)
    cfg = load_config(BASE + args + ["--job.dump_folder", dump])
    trainer = Trainer(prepare(cfg, 1, 0), torch.device("cpu"))
    history: list[dict] = []
    try:
        trainer.train(history)
    finally:
        trainer.close()
    return _peaks(history)


def measure_torchrun(ngpu: int, jobs: dict[str, list[str]], tmp: str) -> dict[str, dict]:
    """Train every job on `ngpu` gloo ranks in one torchrun launch; {job: {"peak_bytes" (max over ranks), ...}}."""
    launched = torchrun_jobs(__file__, {name: BASE + args + ["--job.dump_folder", os.path.join(tmp, f"{name}_{ngpu}")]
                                        for name, args in jobs.items()}, ngpu, tmp, timeout_s=1800)
    results = {}
    for name, per_rank in launched.items():
        errors = [p["error"] for p in per_rank if "error" in p]
        results[name] = {"error": errors[0]} if errors else {
            "peak_bytes": max(p["peak_bytes"] for p in per_rank),
            "per_rank_peak_bytes": [p["peak_bytes"] for p in per_rank],
            "activations_at_peak_bytes": max(p["activations_at_peak_bytes"] for p in per_rank),
            "per_rank_activations_at_peak_bytes": [p["activations_at_peak_bytes"] for p in per_rank],
            # each step's slowest rank: the step waits for it
            "tokens_per_s": [min(steps) for steps in zip(*(p["tokens_per_s"] for p in per_rank))]}
    return results


def _train_row(args: list[str]) -> dict:
    """One job on this rank: its peaks, or the error of a job the trainer cannot run (reported as a row, the
    others still run)."""
    from trainer.job_config import load_config
    from trainer.train import run

    history: list[dict] = []
    try:
        run(load_config(args), shutdown=False, history=history)
        return _peaks(history)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def _row(ngpu: int, ep: int, ac: str, batch: int, seq: int, steps: int, measured: dict, predicted: dict, recipe: str,
         dtype: str) -> dict:
    if "error" in measured:
        return {"ngpu": ngpu, "ep": ep, "ac": ac, "fp8": recipe, "dtype": dtype, "batch": batch, "seq_len": seq,
                "steps": steps,
                "predicted_peak_MiB": round(predicted["predicted_peak_bytes"] / 2 ** 20, 2),
                "measured_peak_MiB": None, "ratio": None, "within_15pct": None,
                "predicted_phase": predicted["peak_phase"], "training_error": measured["error"]}
    ratio = predicted["predicted_peak_bytes"] / measured["peak_bytes"]
    return {"ngpu": ngpu, "ep": ep, "ac": ac, "fp8": recipe, "dtype": dtype, "batch": batch, "seq_len": seq,
            "steps": steps,
            "predicted_peak_MiB": round(predicted["predicted_peak_bytes"] / 2 ** 20, 2),
            "measured_peak_MiB": round(measured["peak_bytes"] / 2 ** 20, 2),
            "ratio": round(ratio, 4), "within_15pct": abs(ratio - 1) <= TOLERANCE,
            "predicted_phase": predicted["peak_phase"],
            "predicted_activations_after_forward_MiB": round(predicted["activation_bytes"] / 2 ** 20, 2),
            "measured_activations_at_peak_MiB": round(measured["activations_at_peak_bytes"] / 2 ** 20, 2),
            "per_rank_measured_MiB": [round(b / 2 ** 20, 2) for b in measured.get(
                "per_rank_peak_bytes", [measured["peak_bytes"]])]}


def run_check(smoke: bool = False, steps: int = 3, recipe: str = "none", dtype: str = "float32",
              layout: tuple[int, int] | None = None) -> list[dict]:
    """All rows (or the smoke row, or the rows of the one layout (ngpu, ep)); prints and returns them."""
    rows = []
    modes = ["none"] if smoke else ["none", "full", "selective"]
    layouts = [(1, 1, 2, 128)] if smoke else [(1, 1, 4, 256), (2, 2, 2, 256), (4, 4, 2, 256)]
    if layout is not None and not smoke:
        layouts = [(layout[0], layout[1], 2, 256)]
    steps = 2 if smoke else steps
    with tempfile.TemporaryDirectory() as tmp:
        for ngpu, ep, batch, seq in layouts:
            jobs = {ac: row_args(ngpu, ac, batch, seq, steps, recipe, dtype, ep) for ac in modes}
            t0 = time.perf_counter()
            if ngpu == 1:
                measured = {ac: measure_in_process(args, os.path.join(tmp, ac)) for ac, args in jobs.items()}
            else:
                measured = measure_torchrun(ngpu, jobs, tmp)
            for ac, args in jobs.items():
                row = _row(ngpu, ep, ac, batch, seq, steps, measured[ac], predict(ngpu, args), recipe, dtype)
                row["wall_s_layout"] = round(time.perf_counter() - t0, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main(argv: list[str]) -> None:
    """CLI; exits 1 when a row is outside the tolerance."""
    if help_or_worker(argv, __doc__, _train_row):
        return
    def value(flag: str, default: str) -> str:
        return argv[argv.index(flag) + 1] if flag in argv else default

    layout = (int(value("--ngpu", "0")), int(value("--ep", "0"))) if "--ngpu" in argv else None
    if layout is not None and layout[0] % max(layout[1], 1):
        sys.exit("--ep must divide --ngpu")
    rows = run_check(smoke="--smoke" in argv, steps=int(value("--steps", "3")), recipe=value("--fp8", "none"),
                     dtype=value("--dtype", "float32"), layout=layout)
    # rows the trainer could not run (within_15pct None) are reported, not counted as misses
    if any(r["within_15pct"] is False for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    import logging

    logging.disable(logging.INFO)  # the trainer's per-step log lines would bury the JSON rows
    main(sys.argv[1:])
