"""What gathering blockwise FP8 weights as e4m3 blocks (`fp8.all_gather`) changes, measured on gloo CPU ranks.

`.venv/bin/python benchmarks/fp8_all_gather.py [--smoke] [--steps N] [-- trainer overrides]` trains the debug
model with the blockwise recipe in bf16 on FSDP 2 and on FSDP 4 x EP 2 (the routed experts FSDP-sharded over the 2
ranks EP leaves, as DeepSeek-V3's layouts shard them), each with `fp8.all_gather` true and false, in one torchrun
launch per layout, and prints one JSON object per layout:
- the bytes FSDP's all-gathers deliver to each rank per step (counted at FSDP's all-gather call), with and without;
- each run's peak tensor memory (exact tracking, the largest rank; per step too) and the memory plan's prediction
  (the peaks move by a few MiB with the timing of gloo's asynchronous all-gathers: on a loaded machine a 2-step run
  measured the same peak both ways);
- whether the two runs' losses and gradient norms are equal (the GEMMs multiply the same e4m3 values);
- tokens/s, which on CPU measures gloo and the emulation, not a GPU's FP8 kernels (docs/fp8.md).
`--smoke` runs the FSDP 2 layout for 2 steps.
"""

from __future__ import annotations

import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import jobs_benchmark_cli, print_row, torchrun_jobs  # noqa: E402

BASE = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"), "--memory.track", "exact",
        "--metrics.enable_tensorboard", "false", "--validation.enable", "false", "--checkpoint.enable", "false",
        "--metrics.log_freq", "1", "--fp8.recipe", "blockwise", "--training.dtype", "bfloat16",
        "--training.local_batch_size", "2", "--training.seq_len", "256", "--training.deterministic", "true"]
RATE = "throughput/rank_tokens_per_s"
LAYOUTS = {"fsdp2": (2, 1), "fsdp4_ep2": (4, 2)}


def _layout_args(ngpu: int, ep: int) -> list[str]:
    return ["--parallelism.data_parallel_shard_degree", str(ngpu), "--parallelism.expert_parallel_degree", str(ep)]


def _train(args: list[str]) -> dict:
    """One job on this rank, counting the bytes FSDP's all-gathers deliver here."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from trainer.job_config import load_config
    from trainer.train import run

    gathered = [0]
    original = _fsdp_collectives.DefaultAllGather.__call__

    def counting(self, output_tensor, input_tensor, group, async_op):
        gathered[0] += output_tensor.numel() * output_tensor.element_size()
        return original(self, output_tensor, input_tensor, group, async_op)

    _fsdp_collectives.DefaultAllGather.__call__ = counting
    history: list[dict] = []
    try:
        run(load_config(args), shutdown=False, history=history)
    finally:
        _fsdp_collectives.DefaultAllGather.__call__ = original
    return {"gathered_bytes": gathered[0], "steps": len(history),
            "step_peak_bytes": [h["memory/peak_allocated_GiB"] * 2 ** 30 for h in history],
            "losses": [h["loss"] for h in history], "grad_norms": [h["grad_norm"] for h in history],
            "tokens_per_s": [h[RATE] for h in history[1:] if RATE in h]}


def _predicted_peak(ngpu: int, args: list[str]) -> float:
    from trainer.job_config import load_config
    from trainer.tools.memory_plan import plan

    return plan(load_config(args), ngpu, "cpu")["ranks"][0]["predicted_peak_bytes"]


def _summary(name: str, runs: dict[str, list[dict]], args: dict[str, list[str]], ngpu: int, ep: int) -> dict:
    row = {"layout": name, "ngpu": ngpu, "ep": ep}
    for key, per_rank in runs.items():
        steps = per_rank[0]["steps"]
        rates = [min(r) for r in zip(*(p["tokens_per_s"] for p in per_rank))]
        row[key] = {"gathered_MiB_per_rank_per_step": round(max(p["gathered_bytes"] for p in per_rank) / steps
                                                            / 2 ** 20, 3),
                    "peak_MiB": round(max(max(p["step_peak_bytes"]) for p in per_rank) / 2 ** 20, 2),
                    # each step's largest rank: the first steps also allocate the optimizer state
                    "step_peaks_MiB": [round(max(b) / 2 ** 20, 2) for b in zip(*(p["step_peak_bytes"]
                                                                                  for p in per_rank))],
                    "predicted_peak_MiB": round(_predicted_peak(ngpu, args[key]) / 2 ** 20, 2),
                    "tokens_per_s_median": sorted(rates)[len(rates) // 2] if rates else None,
                    "losses": per_rank[0]["losses"]}
    on, off = row["all_gather_on"], row["all_gather_off"]
    row["gathered_ratio"] = round(on["gathered_MiB_per_rank_per_step"] / off["gathered_MiB_per_rank_per_step"], 4)
    row["peak_ratio"] = round(on["peak_MiB"] / off["peak_MiB"], 4)
    row["same_losses_and_grad_norms"] = all(
        runs["all_gather_on"][0][k] == runs["all_gather_off"][0][k] for k in ("losses", "grad_norms"))
    return row


def run_benchmark(smoke: bool = False, steps: int = 4, extra: list[str] | None = None) -> list[dict]:
    """Every layout (the smoke one only with `smoke`), printed as it completes; returns the rows."""
    rows = []
    layouts = {"fsdp2": LAYOUTS["fsdp2"]} if smoke else LAYOUTS
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ngpu, ep) in layouts.items():
            args = {key: BASE + _layout_args(ngpu, ep) + ["--training.steps", str(2 if smoke else steps),
                                                          "--fp8.all_gather", value,
                                                          "--job.dump_folder", os.path.join(tmp, f"{name}_{key}")]
                    + (extra or []) for key, value in (("all_gather_on", "true"), ("all_gather_off", "false"))}
            runs = torchrun_jobs(__file__, args, ngpu, tmp, timeout_s=1200)
            row = _summary(name, runs, args, ngpu, ep)
            print_row(row, rows)
    return rows


def main(argv: list[str]) -> None:
    """CLI (see the module docstring)."""
    jobs_benchmark_cli(argv, __doc__, _train, run_benchmark)


if __name__ == "__main__":
    main(sys.argv[1:])
