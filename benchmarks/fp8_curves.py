"""Loss curves of the FP8 recipes against high precision: the same job, seed and data with fp8.recipe none,
rowwise and blockwise, one after the other in this process.

    python benchmarks/fp8_curves.py                                   # debug model, 200 steps of 2 x 128 tokens
    python benchmarks/fp8_curves.py --steps 3 --seq-len 32 --recipes none,blockwise      # a smoke run
    python benchmarks/fp8_curves.py --plot docs/fp8_curves.png        # also draw the curves

Every run: train_configs/debug_model.toml, fp32 master weights and compute (FP8 GEMM inputs where the recipe
converts), memory tracking off, validation once after the last step, no tensorboard, dump folder in a temporary directory. Extra trainer
flags after `--` go to every run. The rowwise recipe needs torchao (its linears are torchao's Float8Linear).

Output: one JSON object on stdout:
  machine   CPU, cores, torch threads and version, load average before
  config    steps, local_batch_size, seq_len, recipes, extra args
  runs      {recipe: {"loss": [per-step training loss], "final_loss": mean loss of the last 10 steps,
             "final_val_loss": validation loss after the last step (--val-steps batches of the validation split,
             the same for every recipe), "seconds": wall time of the run}}
  final_loss_rel_diff       {recipe: final_loss / final_loss of none - 1} for every FP8 recipe (the issue's
                            target: within 1.5%)
  final_val_loss_rel_diff   the same for final_val_loss (less noisy: more tokens, the same for every recipe)
"""

from __future__ import annotations

import argparse
import json
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


def run_recipe(recipe: str, steps: int, batch: int, seq_len: int, val_steps: int, extra: list[str],
               folder: str) -> dict:
    """Train one recipe; returns its per-step losses, final loss, final validation loss and wall time."""
    from trainer.job_config import load_config
    from trainer.train import run

    args = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--fp8.recipe", recipe,
            "--training.steps", str(steps), "--training.local_batch_size", str(batch),
            "--training.seq_len", str(seq_len), "--memory.track", "off", "--validation.enable", "true",
            "--validation.freq", str(steps), "--validation.steps", str(val_steps),
            "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "10",
            "--job.dump_folder", str(Path(folder) / recipe), *extra]
    start = time.perf_counter()
    history: list[dict] = []
    losses = run(load_config(args), history=history)
    window = losses[-min(FINAL_WINDOW, len(losses)):]
    return {"loss": losses, "final_loss": sum(window) / len(window),
            "final_val_loss": history[-1]["validation/loss"], "seconds": time.perf_counter() - start}


def plot(report: dict, path: str) -> None:
    """The loss curves of every recipe, and each FP8 recipe's loss relative to none, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[2, 1])
    color = {recipe: f"C{i}" for i, recipe in enumerate(runs)}  # one colour per recipe in both panels
    for recipe, run in runs.items():
        top.plot(range(1, len(run["loss"]) + 1), run["loss"], label=f"{recipe} (final {run['final_loss']:.3f})",
                 linewidth=1, color=color[recipe])
    top.set_ylabel("training loss")
    top.legend()
    cfg = report["config"]
    top.set_title(f"debug model, {cfg['steps']} steps of {cfg['local_batch_size']} x {cfg['seq_len']} tokens, "
                  "same seed and data")
    if "none" in runs:
        base = runs["none"]["loss"]
        for recipe, run in runs.items():
            if recipe != "none":
                rel = [100 * (a / b - 1) for a, b in zip(run["loss"], base)]
                bottom.plot(range(1, len(rel) + 1), rel, label=recipe, linewidth=1, color=color[recipe])
        bottom.axhline(0, color="gray", linewidth=0.5)
        bottom.set_ylabel("loss vs none (%)")
        bottom.legend()
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = split_passthrough(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--recipes", default="none,rowwise,blockwise")
    parser.add_argument("--val-steps", type=int, default=20, help="validation batches after the last step")
    parser.add_argument("--plot", default="", help="write the curves to this PNG")
    parser.add_argument("--out", default="", help="also write the report here after every recipe (long runs)")
    opts = parser.parse_args(own)
    recipes = opts.recipes.split(",")
    report = {"machine": machine_info(),
              "config": {"steps": opts.steps, "local_batch_size": opts.batch, "seq_len": opts.seq_len,
                         "recipes": recipes, "args": extra},
              "runs": {}}
    with tempfile.TemporaryDirectory() as folder:
        for recipe in recipes:
            report["runs"][recipe] = run_recipe(recipe, opts.steps, opts.batch, opts.seq_len, opts.val_steps, extra,
                                                folder)
            if opts.out:
                Path(opts.out).write_text(json.dumps(report))
    if "none" in report["runs"]:
        base = report["runs"]["none"]["final_loss"]
        base_val = report["runs"]["none"]["final_val_loss"]
        report["final_loss_rel_diff"] = {r: run["final_loss"] / base - 1 for r, run in report["runs"].items()
                                         if r != "none"}
        report["final_val_loss_rel_diff"] = {r: run["final_val_loss"] / base_val - 1
                                             for r, run in report["runs"].items() if r != "none"}
    if opts.plot:
        plot(report, opts.plot)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
