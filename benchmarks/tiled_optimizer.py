"""Peak memory of a training step with and without the tiled optimizer step, measured exactly on CPU.

    .venv/bin/python benchmarks/tiled_optimizer.py [--experts 64] [--steps 3] [--max-group-bytes 16777216]
                                                   [--implementation foreach]

Builds the DeepSeek-V3 debug model through the trainer's own pieces (`prepare`, `Trainer`), with the number of
routed experts raised (many large expert weights) and a tiny batch (2 x 32 tokens), so that the optimizer step
and not the activations sets the step's peak. Runs the same seeded, deterministic steps twice, once with
``optimizer.max_group_bytes = 0`` and once tiled, with the exact memory tracker (``memory.track = "exact"``),
then prints one JSON object: the peak of each run (the highest per-step peak), the reduction, the max absolute
parameter difference after the steps (0.0 means bit-identical) and the untracked step time of both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.deepseek_v3.args import FLAVORS  # noqa: E402
from models.deepseek_v3.hf import hf_config_from_args  # noqa: E402
from trainer.job_config import load_config  # noqa: E402
from trainer.train import Trainer, prepare  # noqa: E402


def _trainer(workdir: str, hf_config: str, max_group_bytes: int, track: str, implementation: str) -> Trainer:
    cfg = load_config([
        "--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", workdir,
        "--model.hf_config_path", hf_config, "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.deterministic", "true", "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
        "--memory.track", track, "--optimizer.max_group_bytes", str(max_group_bytes),
        "--optimizer.implementation", implementation,
    ])
    return Trainer(prepare(cfg, world_size=1, rank=0), torch.device("cpu"))


def _run(workdir: str, hf_config: str, max_group_bytes: int, steps: int,
         implementation: str) -> tuple[int, list[torch.Tensor], int]:
    """Peak bytes over `steps` tracked steps, the parameters afterwards, and the optimizer's group count."""
    trainer = _trainer(workdir, hf_config, max_group_bytes, "exact", implementation)
    peak = 0
    with trainer.memory:
        for step in range(1, steps + 1):
            trainer.train_step(step)
            peak = max(peak, trainer.memory.step_end().peak_bytes)
    params = [p.detach().clone() for p in trainer.model_parts[0].parameters()]
    return peak, params, len(trainer.optimizers[0].param_groups)


def _step_time(workdir: str, hf_config: str, max_group_bytes: int, steps: int, implementation: str) -> float:
    """Median untracked wall time of a training step (the first step, which creates the state, excluded)."""
    trainer = _trainer(workdir, hf_config, max_group_bytes, "off", implementation)
    trainer.train_step(1)
    times = []
    for step in range(2, steps + 2):
        t0 = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer (debug model: 8)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--max-group-bytes", type=int, default=16 << 20, help="tile size of the tiled run")
    parser.add_argument("--implementation", default="foreach", choices=["foreach", "for-loop", "fused"],
                        help="optimizer.implementation of both runs")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the same kernels in both runs, so that bit-identity is a fair claim
    model_args = FLAVORS["debugmodel"].replace(n_routed_experts=args.experts)
    with tempfile.TemporaryDirectory() as workdir:
        hf_config = os.path.join(workdir, "config.json")
        with open(hf_config, "w") as f:
            json.dump(hf_config_from_args(model_args), f)
        impl = args.implementation
        peak_untiled, params_untiled, _ = _run(workdir, hf_config, 0, args.steps, impl)
        peak_tiled, params_tiled, groups = _run(workdir, hf_config, args.max_group_bytes, args.steps, impl)
        time_untiled = _step_time(workdir, hf_config, 0, args.steps, impl)
        time_tiled = _step_time(workdir, hf_config, args.max_group_bytes, args.steps, impl)
    param_bytes = sum(p.numel() * p.element_size() for p in params_untiled)
    max_diff = max((a - b).abs().max().item() for a, b in zip(params_untiled, params_tiled))
    print(json.dumps({
        "model": f"debugmodel with {args.experts} routed experts, batch 2 x 32 tokens, fp32, AdamW {impl}",
        "param_bytes": param_bytes,
        "max_group_bytes": args.max_group_bytes,
        "param_groups_tiled": groups,
        "steps": args.steps,
        "peak_bytes_untiled": peak_untiled,
        "peak_bytes_tiled": peak_tiled,
        "reduction_percent": round(100.0 * (peak_untiled - peak_tiled) / peak_untiled, 2),
        "max_abs_param_diff": max_diff,
        "step_seconds_untiled": round(time_untiled, 4),
        "step_seconds_tiled": round(time_tiled, 4),
    }, indent=2))


if __name__ == "__main__":
    main()
