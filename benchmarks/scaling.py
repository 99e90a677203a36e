"""Multi-rank scaling on CPU: N gloo ranks training one job with expert parallelism (EP = N) against N independent
single-process runs sharing the same cores; both measured with `benchmarks/throughput.py`.

    python benchmarks/scaling.py                         # debug model, 4 x 256, fp32, 2 ranks: 2 warm-up + 10 timed
    python benchmarks/scaling.py --steps 20 --training.dtype bfloat16      # + any throughput.py or trainer flag
    python benchmarks/scaling.py --smoke                 # throughput.py's tiny model, 2 timed steps: what the tests run

Two measurements, one after the other, same model, batch per rank, seq_len and dtype (default:
train_configs/debug_model.toml at seq 256, batch 4, memory.track off, fp32; extra flags go to every run, later
flags win):
  independent      N `benchmarks/throughput.py` processes launched together, each on its own: no process group,
                   no communication. They share the cores as N ranks would.
  expert_parallel  one `torch.distributed.run --standalone --nproc_per_node=N benchmarks/throughput.py` with
                   `--parallelism.expert_parallel_degree N`: data-parallel shard N (FSDP over the N ranks), the
                   routed experts split over the N ranks (all-to-all dispatch and combine). Each rank trains a
                   batch of its own, so the job sees N times the batch of one independent run, as N independent
                   runs together do.
Every process runs with OMP_NUM_THREADS = cores // N (at least 1), so torch uses that many threads: N processes
fill the cores without oversubscribing them.

Output: one JSON object on stdout (the runs' logs go to temporary files; a failing run's tail is raised):
  machine      CPU model, cores, torch threads (of the runs), torch version, load average before and after the
               two measurements (other processes on the machine make every number slower and noisier)
  config       model, dtype, batch (per rank), seq_len, steps, warmup, memory_track (as the runs report them),
               nproc (N), threads_per_process, args (the flags given to every run)
  independent
    aggregate_tokens_per_s  sum of the runs' tokens/s (each at its median step time)
    tokens_per_s            every run's tokens/s
    step_time_s             every run's median step time
    reports                 every run's full throughput.py report
  expert_parallel
    aggregate_tokens_per_s  the job's tokens/s: sum over ranks of each rank's tokens/s at its median step time
    tokens_per_s            rank 0's
    step_time_s             every rank's median step time, by rank
    communication_s         rank 0's communication time in the profiled step (collectives and their waits: the
                            EP all-to-all, FSDP all-gather and reduce-scatter, the trainer's all-reduces)
    communication_share     communication_s / rank 0's profiled step time (CPU time of its training thread)
    report                  rank 0's full throughput.py report
  ratio        expert_parallel.aggregate_tokens_per_s / independent.aggregate_tokens_per_s: what running one
               job over N ranks keeps of what the cores do as N separate runs (the issue's target: >= 0.8 for
               N = 2, EP = 2)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.common import machine_info  # noqa: E402  (needs the repo root on sys.path)

THROUGHPUT = str(REPO / "benchmarks" / "throughput.py")
DEFAULT_ARGS = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "256",
                "--training.local_batch_size", "4", "--memory.track", "off", "--training.dtype", "float32"]


def _launch(stack: contextlib.ExitStack, cmd: list[str], threads: int, log_path: str):
    """Start `cmd` in the repo with `threads` OpenMP/torch threads, stdout piped (the report), stderr to a log
    file; the process is killed when `stack` closes if it is still running (another run failed)."""
    log = stack.enter_context(open(log_path, "w+"))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    stack.callback(lambda: proc.poll() is None and proc.kill())
    return proc, log


def _report(proc: subprocess.Popen, log, what: str) -> dict:
    """The JSON report `proc` prints; on failure, raise with the tail of its log."""
    out, _ = proc.communicate()
    if proc.returncode != 0:
        log.seek(0)
        raise RuntimeError(f"{what} failed (exit code {proc.returncode}):\n{log.read()[-4000:]}")
    return json.loads(out)


def run(nproc: int, throughput_args: list[str]) -> dict:
    """Measure `nproc` independent runs, then one `nproc`-rank EP job; returns the report."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="scaling_") as tmp, contextlib.ExitStack() as stack:
        # launched together so their timed steps overlap: each gets the share of the cores one rank would
        runs = [_launch(stack, [sys.executable, THROUGHPUT] + throughput_args, threads,
                        os.path.join(tmp, f"independent_{i}.log")) for i in range(nproc)]
        independent = [_report(proc, log, f"independent run {i}") for i, (proc, log) in enumerate(runs)]

        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               THROUGHPUT] + throughput_args + ["--parallelism.expert_parallel_degree", str(nproc)]
        ep = _report(*_launch(stack, cmd, threads, os.path.join(tmp, "expert_parallel.log")), "torchrun")
    machine["load_average_after"] = os.getloadavg()
    machine["torch_threads"] = ep["machine"]["torch_threads"]  # the runs' threads, not this launcher's

    independent_aggregate = sum(r["tokens_per_s"] for r in independent)
    split = ep["time_split_s"]
    config = ep["config"]
    return {
        "machine": machine,
        "config": {**{k: config[k] for k in ("model", "dtype", "batch", "seq_len", "steps", "warmup", "memory_track")},
                   "nproc": nproc, "threads_per_process": threads, "args": throughput_args},
        "independent": {
            "aggregate_tokens_per_s": independent_aggregate,
            "tokens_per_s": [r["tokens_per_s"] for r in independent],
            "step_time_s": [r["step_time_s"]["median"] for r in independent],
            "reports": independent,
        },
        "expert_parallel": {
            "aggregate_tokens_per_s": ep["aggregate_tokens_per_s"],
            "tokens_per_s": ep["tokens_per_s"],
            "step_time_s": ep["rank_step_time_s"],
            "communication_s": split["communication"],
            "communication_share": split["communication"] / sum(split.values()),
            "report": ep,
        },
        "ratio": ep["aggregate_tokens_per_s"] / independent_aggregate,
    }


def main(argv: list[str] | None = None) -> dict:
    """Parse the flags, run both measurements and print (and return) the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the EP job, and independent runs")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of every run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--smoke", action="store_true", help="throughput.py --smoke (tiny model, 2 timed steps)")
    args, extra = parser.parse_known_args(argv)
    if args.smoke:  # throughput.py's own smoke model and steps; memory tracking off as in the real measurement
        throughput_args = ["--smoke", "--memory.track", "off"] + extra
    else:
        throughput_args = DEFAULT_ARGS + ["--steps", str(args.steps), "--warmup", str(args.warmup)] + extra
    report = run(args.nproc, throughput_args)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
