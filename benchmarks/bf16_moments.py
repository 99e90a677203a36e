"""BF16 AdamW moments against float32 moments: the same job, seed and data with optimizer.state_dtype float32 and
bfloat16, one after the other in this process.

    python benchmarks/bf16_moments.py                        # debug model as configured, 200 steps each way
    python benchmarks/bf16_moments.py --steps 3              # a smoke run
    python benchmarks/bf16_moments.py -- --training.seq_len 64   # extra trainer flags go to both runs

Every run: train_configs/debug_model.toml (its batch and sequence length unless overridden after `--`),
deterministic kernels, memory tracking off, validation once after the last step, no tensorboard, dump folder in a
temporary directory.

Output: one JSON object on stdout:
  machine    CPU, cores, torch threads and version, load average before
  config     steps, extra args
  runs       {state_dtype: {"loss": [per-step training loss], "final_loss": mean of the last 10 steps,
              "final_val_loss": validation loss after the last step, "params": parameter count,
              "optimizer_state_bytes": bytes of the optimizer's state tensors after the run (moments and step
              counters, summed over the tensors themselves), "step_s_median": median wall time of a step (the first
              excluded), "seconds": wall time of the run}}
  loss_rel_diff          per-step |bf16 / fp32 - 1|: max, the step of the max, mean, and the mean over the last 10
  final_loss_rel_diff    final_loss of bfloat16 / float32 - 1 (the issue's bound: within 0.5%)
  final_val_loss_rel_diff  the same for the validation loss
  optimizer_state_saved_bytes  float32 minus bfloat16 state bytes, and per parameter
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.common import machine_info  # noqa: E402  (needs the repo root on sys.path)

#: the final loss is averaged over this many last steps: one step's loss depends on its batch
FINAL_WINDOW = 10


def run_state_dtype(state_dtype: str, steps: int, extra: list[str], folder: str) -> dict:
    """Train with `state_dtype` moments; returns the losses, final losses, state bytes and step times."""
    import torch

    from trainer.job_config import load_config
    from trainer.train import Trainer, prepare

    args = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--optimizer.state_dtype", state_dtype, "--training.steps", str(steps),
            "--training.deterministic", "true", "--memory.track", "off", "--validation.enable", "true",
            "--validation.freq", str(steps), "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "50",
            "--job.dump_folder", str(Path(folder) / state_dtype), *extra]
    start = time.perf_counter()
    trainer = Trainer(prepare(load_config(args), world_size=1, rank=0), torch.device("cpu"))
    times: list[float] = []

    @contextlib.contextmanager
    def timed(step):
        t0 = time.perf_counter()
        yield
        times.append(time.perf_counter() - t0)

    history: list[dict] = []
    try:
        losses = trainer.train(history, around_step=timed)
    finally:
        trainer.close()
    state = [t for opt in trainer.optimizers for per_param in opt.state.values() for t in per_param.values()]
    window = losses[-min(FINAL_WINDOW, len(losses)):]
    return {"loss": losses, "final_loss": sum(window) / len(window),
            "final_val_loss": history[-1]["validation/loss"],
            "params": sum(p.numel() for part in trainer.model_parts for p in part.parameters()),
            "optimizer_state_bytes": sum(t.untyped_storage().nbytes() for t in state),
            "step_s_median": statistics.median(times[1:] or times), "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    opts = parser.parse_args(own)
    report = {"machine": machine_info(), "config": {"steps": opts.steps, "args": extra}, "runs": {}}
    with tempfile.TemporaryDirectory() as folder:
        for state_dtype in ("float32", "bfloat16"):
            report["runs"][state_dtype] = run_state_dtype(state_dtype, opts.steps, extra, folder)
    fp32, bf16 = report["runs"]["float32"], report["runs"]["bfloat16"]
    rel = [abs(b / a - 1) for a, b in zip(fp32["loss"], bf16["loss"])]
    worst = max(range(len(rel)), key=rel.__getitem__)
    tail = rel[-min(FINAL_WINDOW, len(rel)):]
    report["loss_rel_diff"] = {"max": rel[worst], "max_at_step": worst + 1, "mean": sum(rel) / len(rel),
                               "mean_last_10": sum(tail) / len(tail)}
    report["final_loss_rel_diff"] = bf16["final_loss"] / fp32["final_loss"] - 1
    report["final_val_loss_rel_diff"] = bf16["final_val_loss"] / fp32["final_val_loss"] - 1
    saved = fp32["optimizer_state_bytes"] - bf16["optimizer_state_bytes"]
    report["optimizer_state_saved_bytes"] = {"bytes": saved, "per_param": saved / fp32["params"]}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
