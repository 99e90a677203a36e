"""What FP8 dispatch (`fp8.dispatch`) changes, measured on gloo CPU ranks.

`.venv/bin/python benchmarks/fp8_dispatch.py [--smoke] [--steps N] [-- trainer overrides]` trains the debug model
with the blockwise recipe in bf16 on 2 ranks with EP 2, for each comm backend (all-to-all, and DeepEP through its
CPU stand-in) and each activation-checkpointing mode (none, selective with the exchanges saved, full), with
`fp8.dispatch` true and false, all in one torchrun launch, and prints one JSON object per backend and AC mode:
- the bytes this rank hands to all-to-alls per step (counted at the collectives: the functional all_to_all_single
  the all-to-all backend runs, forward and backward, and the stand-in's `dist.all_to_all_single`), with and
  without, and the step-time model's planned bytes of the token rows (forward: dispatch and combine; and with the
  backward's two gradients and full AC's replay of the forward's; the measured bytes also hold the expert counts
  and routing weights);
- each run's peak tensor memory (exact tracking, the larger rank) and the memory plan's prediction;
- whether the two runs' losses and gradient norms are equal (the experts quantise the same 1 x 128 tiles).
Tokens/s on CPU measures gloo and the emulation, not a GPU's kernels or links: not reported. `--smoke` runs the
all-to-all backend without AC for 2 steps.
"""

from __future__ import annotations

import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import jobs_benchmark_cli, print_row, torchrun_jobs  # noqa: E402

NGPU = 2
BASE = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"), "--memory.track", "exact",
        "--metrics.enable_tensorboard", "false", "--validation.enable", "false", "--checkpoint.enable", "false",
        "--metrics.log_freq", "1", "--fp8.recipe", "blockwise", "--training.dtype", "bfloat16",
        "--training.local_batch_size", "2", "--training.seq_len", "256", "--training.deterministic", "true",
        "--parallelism.data_parallel_shard_degree", str(NGPU), "--parallelism.expert_parallel_degree", str(NGPU)]
BACKENDS = ("alltoall", "deepep")
AC_MODES = ("none", "selective", "full")


def _train(args: list[str]) -> dict:
    """One job on this rank, counting the bytes it hands to all-to-alls."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.job_config import load_config
    from trainer.train import run

    sent = [0]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops._c10d_functional.all_to_all_single.default:
                sent[0] += args[0].numel() * args[0].element_size()
            return func(*args, **(kwargs or {}))

    original = dist.all_to_all_single

    def counting(output, input, *a, **kw):
        sent[0] += input.numel() * input.element_size()
        return original(output, input, *a, **kw)

    dist.all_to_all_single = counting
    history: list[dict] = []
    try:
        with Counting():
            run(load_config(args), shutdown=False, history=history)
    finally:
        dist.all_to_all_single = original
    return {"sent_bytes": sent[0], "steps": len(history),
            "peak_bytes": max(h["memory/peak_allocated_GiB"] for h in history) * 2 ** 30,
            "losses": [h["loss"] for h in history], "grad_norms": [h["grad_norm"] for h in history]}


def _plan(args: list[str]) -> dict:
    from trainer.job_config import load_config
    from trainer.tools.memory_plan import plan

    rank = plan(load_config(args), NGPU, "cpu")["ranks"][0]
    work = rank["work"]
    return {"predicted_peak_MiB": round(rank["predicted_peak_bytes"] / 2 ** 20, 2),
            "planned_forward_exchange_MiB": round(work["a2a_bytes"] / 2 ** 20, 3),
            "planned_exchange_MiB": round((work["a2a_bytes"] + work["a2a_grad_bytes"] + work["a2a_recomputed_bytes"])
                                          / 2 ** 20, 3)}


def _row(backend: str, ac: str, runs: dict[str, list[dict]], args: dict[str, list[str]]) -> dict:
    row = {"backend": backend, "activation_checkpoint": ac, "ngpu": NGPU, "ep": NGPU}
    for key in ("dispatch_on", "dispatch_off"):
        per_rank = runs[key]
        row[key] = {"sent_MiB_per_rank_per_step": round(max(p["sent_bytes"] for p in per_rank)
                                                        / per_rank[0]["steps"] / 2 ** 20, 3),
                    "peak_MiB": round(max(p["peak_bytes"] for p in per_rank) / 2 ** 20, 2),
                    **_plan(args[key]), "losses": per_rank[0]["losses"]}
    on, off = row["dispatch_on"], row["dispatch_off"]
    row["sent_ratio"] = round(on["sent_MiB_per_rank_per_step"] / off["sent_MiB_per_rank_per_step"], 4)
    row["planned_forward_exchange_ratio"] = round(on["planned_forward_exchange_MiB"]
                                                  / off["planned_forward_exchange_MiB"], 4)
    row["peak_saved_MiB"] = round(off["peak_MiB"] - on["peak_MiB"], 2)
    row["planned_peak_saved_MiB"] = round(off["predicted_peak_MiB"] - on["predicted_peak_MiB"], 2)
    row["same_losses_and_grad_norms"] = all(
        runs["dispatch_on"][r][k] == runs["dispatch_off"][r][k] for r in range(NGPU) for k in ("losses", "grad_norms"))
    return row


def run_benchmark(smoke: bool = False, steps: int = 4, extra: list[str] | None = None) -> list[dict]:
    """Every backend and AC mode (the smoke one only with `smoke`), in one launch; prints and returns the rows."""
    cases = [("alltoall", "none")] if smoke else [(b, ac) for b in BACKENDS for ac in AC_MODES]
    with tempfile.TemporaryDirectory() as tmp:
        jobs, args = {}, {}
        for backend, ac in cases:
            for key, value in (("dispatch_on", "true"), ("dispatch_off", "false")):
                name = f"{backend}_{ac}_{key}"
                args[backend, ac, key] = jobs[name] = BASE + [
                    "--parallelism.expert_parallel_comm_backend", backend, "--activation_checkpoint.mode", ac,
                    "--training.steps", str(2 if smoke else steps), "--fp8.dispatch", value,
                    "--job.dump_folder", os.path.join(tmp, name)] + (extra or [])
        runs = torchrun_jobs(__file__, jobs, NGPU, tmp, timeout_s=1200)
        rows = []
        for backend, ac in cases:
            keys = ("dispatch_on", "dispatch_off")
            row = _row(backend, ac, {k: runs[f"{backend}_{ac}_{k}"] for k in keys},
                       {k: args[backend, ac, k] for k in keys})
            print_row(row, rows)
    return rows


def main(argv: list[str]) -> None:
    """CLI (see the module docstring)."""
    jobs_benchmark_cli(argv, __doc__, _train, run_benchmark)


if __name__ == "__main__":
    main(sys.argv[1:])
