"""What the experts' load heatmap costs per logging step (`metrics.expert_load_images`, trainer/expert_load.py),
against a step of the debug model on this machine.

    .venv/bin/python benchmarks/expert_load_image.py [--steps 4] [--repeats 50]

Times `--repeats` times the work a logging step adds on rank 0 (drawing the image and writing it to a tensorboard
event file, PNG encoding included) at the debug model's shapes (5 MoE layers x 8 experts) and at DeepSeek-V3 671B's
(58 x 256), then trains the debug model (`train_configs/debug_model.toml`, memory tracking off, tensorboard off)
for `--steps` steps and takes the median step time after the first. The counts' read joins the step's one
device-to-host copy (a few hundred more numbers), not timed apart. Prints one JSON object: the median ms of each
shape, the debug model's median step in seconds, and the debug shape's cost as a share of that step (the budget
is 1%).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def image_ms(layers: int, experts: int, ep: int, repeats: int, folder: str) -> float:
    """Median ms to draw and write the heatmap of `layers` x `experts` Poisson counts."""
    import numpy as np

    from trainer.expert_load import expert_load_image
    from trainer.metrics import MetricLogger

    rng = np.random.default_rng(0)
    metrics = MetricLogger(folder, rank=0, enable_tensorboard=True, save_for_all_ranks=False)
    times = []
    for step in range(repeats):
        rows = {layer: rng.poisson(100, experts).astype(float).tolist() for layer in range(layers)}
        t0 = time.perf_counter()
        metrics.log_image(step, "moe/tokens_per_expert", expert_load_image(rows, ep))
        times.append(time.perf_counter() - t0)
    metrics.close()
    return statistics.median(times) * 1e3


def step_s(steps: int, folder: str) -> float:
    """Median seconds of the debug model's steps after the first (one process, tracking and tensorboard off)."""
    import torch

    from trainer.job_config import load_config
    from trainer.train import Trainer, prepare

    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", folder,
                       "--training.steps", str(steps), "--memory.track", "off", "--metrics.enable_tensorboard",
                       "false", "--validation.enable", "false"])
    trainer = Trainer(prepare(cfg, 1, 0), torch.device("cpu"))
    times = []

    @contextlib.contextmanager
    def timed(step):
        t0 = time.perf_counter()
        yield
        times.append(time.perf_counter() - t0)

    try:
        trainer.train(around_step=timed)
    finally:
        trainer.close()
    return statistics.median(times[1:])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="The experts' load heatmap's cost per logging step, as JSON.")
    parser.add_argument("--steps", type=int, default=4, help="debug model steps to time (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=50, help="images drawn and written per shape")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        debug = image_ms(5, 8, 1, args.repeats, os.path.join(folder, "debug"))
        large = image_ms(58, 256, 8, args.repeats, os.path.join(folder, "671b"))
        step = step_s(args.steps, os.path.join(folder, "train"))
    print(json.dumps({"debug_5x8_ms": round(debug, 2), "v3_671b_58x256_ms": round(large, 2),
                      "debug_step_s": round(step, 3), "debug_share_of_step_pct": round(100 * debug / 1e3 / step, 3),
                      "repeats": args.repeats, "steps": args.steps}))


if __name__ == "__main__":
    main(sys.argv[1:])
