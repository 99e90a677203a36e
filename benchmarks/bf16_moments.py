"""BF16 AdamW moments against float32 moments: the same job, seed and data with optimizer.state_dtype float32 and
bfloat16 (its moments stored with stochastic rounding, the default, and rounded to nearest); and, as the noise floor
of the comparison, float32 again with torch's foreach AdamW instead of its fused kernel (the same math, rounded
differently in the last bit).

    python benchmarks/bf16_moments.py                        # debug model as configured, 200 steps, four runs
    python benchmarks/bf16_moments.py --jobs 2               # two runs at a time, a torch thread each
    python benchmarks/bf16_moments.py --seeds 0,1,2 --runs float32,bfloat16,float32_foreach  # per seed
    python benchmarks/bf16_moments.py --steps 3 --runs float32,bfloat16  # a smoke run
    python benchmarks/bf16_moments.py -- --training.seq_len 64   # extra trainer flags go to every run
    python benchmarks/bf16_moments.py --device cuda          # on a GPU (the fused bf16 step is then compiled)

Every run: train_configs/debug_model.toml (its batch and sequence length unless overridden after `--`),
deterministic kernels, memory tracking off, validation once after the last step, no tensorboard, dump folder in a
temporary directory. Runs go one after the other in this process, or with `--jobs N` N at a time in child
processes with cores/N torch threads each: the losses are the same either way (deterministic kernels at a fixed
thread count), the times are not comparable.

Output: one JSON object on stdout:
  machine    CPU, cores, torch threads and version, load average before
  config     steps, device, extra args, jobs, runs, seeds
  seeds      per training.seed:
    runs             {float32, bfloat16, bfloat16_nearest, float32_foreach (those asked for): {"loss": [per-step
                     training loss], "final_loss": mean of the last 10 steps, "final_val_loss": validation loss after
                     the last step, "params": parameter count, "optimizer_state_bytes": bytes of the optimizer's state
                     tensors after the run (moments and step counters, summed over the tensors themselves),
                     "step_s_median": median wall time of a step (the first excluded), "optimizer_step_s_median":
                     median wall time of the optimizer step alone (after the run, random gradients, 10 steps after
                     2), "seconds": wall time of the run}}
    against_float32  per other run: "loss_rel_diff", per-step |loss / float32's - 1| (max, the step of the max,
                     mean, mean of the last 10 steps); "final_loss_rel_diff" and "final_val_loss_rel_diff",
                     final_loss and final_val_loss / float32's - 1 (the issue's bound: within 0.5%).
                     bfloat16 is stochastic rounding, bfloat16_nearest rounding to nearest; float32_foreach is the
                     noise floor: how far a last-bit difference of the optimizer moves the curve in this job
                     (training is chaotic: routing decisions flip, and the runs part ways)
  over_seeds       per other run: mean, min, max and the values over the seeds of both final differences
  optimizer_state_saved_bytes  float32 minus bfloat16 state bytes, and per parameter (first seed)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.common import machine_info, split_passthrough  # noqa: E402  (needs the repo root on sys.path)

#: the final loss is averaged over this many last steps: one step's loss depends on its batch
FINAL_WINDOW = 10


def _timer(device) -> contextlib.AbstractContextManager:
    """Wall time of the block, appended to the list it yields; the device is synchronised on both sides."""
    import torch

    @contextlib.contextmanager
    def timed(times: list[float]):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)

    return timed


def optimizer_step_seconds(trainer, timed, repeats: int = 10) -> float:
    """Median time of the optimizer steps alone over the trained model, with random gradients (2 warm-up steps,
    which on CUDA compile the fused bf16 step)."""
    import torch

    params = [p for part in trainer.model_parts for p in part.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    times: list[float] = []
    for i in range(repeats + 2):
        with timed(times if i >= 2 else []):
            for opt in trainer.optimizers:
                opt.step()
    return statistics.median(times)


def run_state_dtype(state_dtype: str, steps: int, extra: list[str], folder: str, device: str) -> dict:
    """Train with `state_dtype` moments (and the `extra` flags); returns the losses, final losses, state bytes and
    step times."""
    import torch

    from trainer.job_config import load_config
    from trainer.train import Trainer, prepare

    args = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--optimizer.state_dtype", state_dtype, "--training.steps", str(steps),
            "--training.deterministic", "true", "--memory.track", "off", "--validation.enable", "true",
            "--validation.freq", str(steps), "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "50",
            "--job.dump_folder", folder, *extra]
    start = time.perf_counter()
    trainer = Trainer(prepare(load_config(args), world_size=1, rank=0), torch.device(device))
    timed = _timer(trainer.device)
    times: list[float] = []
    history: list[dict] = []
    try:
        losses = trainer.train(history, around_step=lambda step: timed(times))
    finally:
        trainer.close()
    optimizer_s = optimizer_step_seconds(trainer, timed)
    state = [t for opt in trainer.optimizers for per_param in opt.state.values() for t in per_param.values()]
    window = losses[-min(FINAL_WINDOW, len(losses)):]
    return {"loss": losses, "final_loss": sum(window) / len(window),
            "final_val_loss": history[-1]["validation/loss"],
            "params": sum(p.numel() for part in trainer.model_parts for p in part.parameters()),
            "optimizer_state_bytes": sum(t.untyped_storage().nbytes() for t in state),
            "step_s_median": statistics.median(times[1:] or times), "optimizer_step_s_median": optimizer_s,
            "seconds": time.perf_counter() - start}


def _run_in_child(threads: int, *args) -> dict:
    """`run_state_dtype` in a child process with `threads` torch threads."""
    import torch

    torch.set_num_threads(threads)
    return run_state_dtype(*args)


def compare(run: dict, base: dict) -> dict:
    """How far `run`'s curve lies from `base`'s: per step, and in its final training and validation losses."""
    rel = [abs(b / a - 1) for a, b in zip(base["loss"], run["loss"])]
    worst = max(range(len(rel)), key=rel.__getitem__)
    tail = rel[-min(FINAL_WINDOW, len(rel)):]
    return {"loss_rel_diff": {"max": rel[worst], "max_at_step": worst + 1, "mean": sum(rel) / len(rel),
                              "mean_last_10": sum(tail) / len(tail)},
            "final_loss_rel_diff": run["final_loss"] / base["final_loss"] - 1,
            "final_val_loss_rel_diff": run["final_val_loss"] / base["final_val_loss"] - 1}


#: the runs the benchmark knows: name -> (optimizer.state_dtype, extra flags)
RUNS = {"float32": ("float32", []), "bfloat16": ("bfloat16", []),
        "bfloat16_nearest": ("bfloat16", ["--optimizer.state_rounding", "nearest"]),
        "float32_foreach": ("float32", ["--optimizer.implementation", "foreach"])}


def spread(values: list[float]) -> dict:
    """Mean, smallest, largest and every value of a per-seed quantity."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "values": values}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = split_passthrough(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", default=",".join(RUNS),
                        help="comma-separated, float32 among them (the base of every comparison); of "
                        + ", ".join(RUNS))
    parser.add_argument("--seeds", default="0", help="comma-separated training.seed values: every run per seed")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (child processes; CPU only)")
    opts = parser.parse_args(own)
    names = opts.runs.split(",")
    if "float32" not in names or not set(names) <= set(RUNS):
        parser.error(f"--runs {opts.runs}: float32 and any of {', '.join(RUNS)}")
    if opts.jobs < 1 or (opts.jobs > 1 and opts.device != "cpu"):
        parser.error("--jobs: 1 or more, and 1 with --device cuda (one GPU)")
    seeds = [int(seed) for seed in opts.seeds.split(",")]
    report = {"machine": machine_info(), "config": {"steps": opts.steps, "device": opts.device, "args": extra,
                                                    "jobs": opts.jobs, "runs": names, "seeds": seeds}}
    with tempfile.TemporaryDirectory() as folder:
        jobs = {(seed, name): (RUNS[name][0], opts.steps, extra + RUNS[name][1] + ["--training.seed", str(seed)],
                               str(Path(folder) / f"{seed}_{name}"), opts.device)
                for seed in seeds for name in names}
        if opts.jobs == 1:
            results = {key: run_state_dtype(*job) for key, job in jobs.items()}
        else:
            threads = max(1, (os.cpu_count() or 1) // opts.jobs)
            with concurrent.futures.ProcessPoolExecutor(opts.jobs, mp_context=multiprocessing.get_context("spawn")) \
                    as pool:
                futures = {key: pool.submit(_run_in_child, threads, *job) for key, job in jobs.items()}
                results = {key: future.result() for key, future in futures.items()}
    report["seeds"] = {}
    for seed in seeds:
        runs = {name: results[seed, name] for name in names}
        report["seeds"][str(seed)] = {"runs": runs, "against_float32": {
            name: compare(run, runs["float32"]) for name, run in runs.items() if name != "float32"}}
    report["over_seeds"] = {
        name: {key: spread([report["seeds"][str(seed)]["against_float32"][name][key] for seed in seeds])
               for key in ("final_loss_rel_diff", "final_val_loss_rel_diff")}
        for name in names if name != "float32"}
    if "bfloat16" in names:
        fp32, bf16 = results[seeds[0], "float32"], results[seeds[0], "bfloat16"]
        saved = fp32["optimizer_state_bytes"] - bf16["optimizer_state_bytes"]
        report["optimizer_state_saved_bytes"] = {"bytes": saved, "per_param": saved / fp32["params"]}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
