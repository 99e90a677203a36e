"""What torch.compile gains on one model: step time, memory and compile time, eager vs compiled, per dtype.

    python benchmarks/compile_gain.py                    # debug model, batch 4 x 256, fp32 and bf16, 10 timed steps
    python benchmarks/compile_gain.py --steps 20 --dtypes bfloat16 --training.seq_len 512   # + any trainer flag
    python benchmarks/compile_gain.py --profile          # + the top ops of one step of every variant
    python benchmarks/compile_gain.py --smoke            # tiny model, 2 steps, fp32, dynamo only: what the tests run

Every variant (dtype x eager/compiled) runs in a fresh process, so compile caches, allocator arenas and peak
resident sizes of one variant cannot leak into another; the inductor cache starts empty (a temporary
TORCHINDUCTOR_CACHE_DIR), so compile_s is a cold compile. A variant trains the config's model (meta build ->
`compile_model` -> materialise -> init, as the trainer does; bf16 through autocast, as the trainer does without
FSDP) with the trainer's optimizer, loss and expert-bias update, on fresh random tokens every step (so routing
changes every step, as in training).

Output: one JSON object on stdout (progress on stderr):
  machine        CPU model, cores, torch threads, torch version, load average before and after (a busy machine
                 makes every number slower and noisier)
  config         model flavor, batch, seq_len, steps, warm-up steps, compile backend
  variants[]     per dtype and compile:
    step_time_s          median wall time of a timed step (forward, backward, optimizer, bias update)
    step_times_s         every timed step
    step_cpu_s           median CPU time of this process per timed step: less sensitive than wall time to other
                         processes on a shared machine (run with --threads 1 there: idle OpenMP threads spin)
    first_step_s         the first step (includes the compile when compiled)
    compile_s            first_step_s - step_time_s: what compiling cost (cold cache)
    tokens_per_s         batch * seq_len / step_time_s
    graphs               graphs dynamo compiled in the whole run; recompiles_after_warmup: those compiled after
                         the warm-up steps (0 expected)
    step_peak_bytes      peak tensor memory of one step above what was allocated when the step began
                         (activations, gradients, temporaries), from the profiler's allocation events
                         (`profile_memory=True` sees every CPU allocation, including inside compiled code;
                         the exact MemTracker cannot measure compiled code). Frees of memory allocated before
                         the step are not reported, so it is an upper bound
    steady_peak_rss_bytes  peak resident set size of the process over the timed steps (VmHWM, reset after the
                         warm-up): everything resident, including the compiler's own memory and malloc arenas
    process_max_rss_bytes  ru_maxrss at the end: the lifetime peak, including the compile itself
    top_ops              with --profile: the ops with the most self CPU time in one step
  gains{dtype}   speedup and cpu_speedup (eager / compiled step time, CPU time), step_peak_reduction and
                 steady_rss_reduction (1 - compiled / eager)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.common import machine_info  # noqa: E402  (needs the repo root on sys.path)

DEFAULT_CONFIG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "256",
                  "--training.local_batch_size", "4"]
# --smoke: the tiny test model; dynamo with the eager backend so the tests' run takes seconds, not minutes
SMOKE_ARGS = dict(vocab_size=64, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=2, n_dense_layers=1, n_heads=2,
                  max_seq_len=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, q_lora_rank=0,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
SMOKE_CONFIG = ["--training.seq_len", "16", "--training.local_batch_size", "2", "--compile.backend", "eager"]

VARIANT_KEYS = ("dtype", "compile", "step_time_s", "step_times_s", "step_cpu_s", "first_step_s", "compile_s",
                "tokens_per_s", "graphs", "recompiles_after_warmup", "step_peak_bytes", "steady_peak_rss_bytes",
                "process_max_rss_bytes", "top_ops")


# ----------------------------------------------------------------------------------------------- one variant

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the next reading is the peak from now on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _step_peak_bytes(step) -> int:
    """Peak of the running sum of allocation events during `step()`, relative to its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def _top_ops(step, n: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    rows = sorted(prof.key_averages(), key=lambda r: r.self_cpu_time_total, reverse=True)[:n]
    return [{"name": r.key, "self_cpu_ms": round(r.self_cpu_time_total / 1e3, 3), "count": r.count} for r in rows]


def run_variant(config_args: list[str], dtype: str, compiled: bool, steps: int, warmup: int, smoke: bool,
                profile_ops: bool, threads: int) -> dict:
    """Train one variant in this process and measure it (see the module docstring)."""
    import contextlib

    import torch
    from torch._dynamo.utils import counters

    from parallelisms.compile import compile_loss
    from parallelisms.parallel_dims import ParallelDims
    from trainer.build import build_model_parts, materialize
    from trainer.job_config import load_config, model_job
    from trainer.optimizer import build_optimizer
    from trainer.registry import get_model_spec

    torch.set_num_threads(threads)
    cfg = load_config(config_args + ["--training.dtype", dtype, "--compile.enable", str(compiled).lower()])
    spec = get_model_spec(cfg.model.name)
    model_args = spec.build_args(model_job(cfg))
    if smoke:
        model_args = model_args.replace(**SMOKE_ARGS)
    torch.manual_seed(cfg.training.seed)
    # the trainer's build path in one process (no process group: no EP, no FSDP)
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    [model] = build_model_parts(spec, model_args, cfg, dims, None).parts
    materialize([model], torch.device("cpu"), cfg.training.seed)
    optimizer = build_optimizer([model], cfg.optimizer)
    loss_fn = compile_loss(spec.build_loss_fn(model_args), cfg.compile)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext())
    batch, seq = cfg.training.local_batch_size, cfg.training.seq_len
    data = torch.Generator().manual_seed(1)

    def step() -> None:
        tokens = torch.randint(0, model_args.vocab_size, (batch, seq + 1), generator=data)
        spec.hooks.before_step([model], batch * seq)
        with autocast:
            out = model(tokens[:, :-1])
        loss = loss_fn(out, tokens[:, 1:]) / (batch * seq)
        del out
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        spec.hooks.post_optimizer_step([model], cfg.moe, None)

    times, cpu_times = [], []
    for i in range(warmup + steps):
        if i == warmup:
            graphs_after_warmup = counters["stats"]["unique_graphs"]
            _reset_peak_rss()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        print(f"  {dtype} compile={compiled} step {i + 1}: {times[-1]:.3f} s", file=sys.stderr)
    steady_rss = _status_kib("VmHWM") * 1024
    graphs = counters["stats"]["unique_graphs"]
    timed = times[warmup:]
    median = statistics.median(timed)
    return {
        "dtype": dtype,
        "compile": compiled,
        "step_time_s": median,
        "step_times_s": timed,
        "step_cpu_s": statistics.median(cpu_times[warmup:]),
        "first_step_s": times[0],
        "compile_s": times[0] - median if compiled else 0.0,
        "tokens_per_s": batch * seq / median,
        "graphs": graphs,
        "recompiles_after_warmup": graphs - graphs_after_warmup,
        "step_peak_bytes": _step_peak_bytes(step),
        "steady_peak_rss_bytes": steady_rss,
        "process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "top_ops": _top_ops(step) if profile_ops else None,
    }


# ----------------------------------------------------------------------------------------------- driver

def _spawn(variant: dict) -> dict:
    """Run one variant in a fresh interpreter with an empty inductor cache; return its JSON result."""
    with tempfile.TemporaryDirectory(prefix="compile_gain_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(variant["threads"]))
        r = subprocess.run([sys.executable, __file__, "--variant", json.dumps(variant)], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"variant {variant['dtype']} compile={variant['compiled']} failed (exit {r.returncode})")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    """Measure every variant in its own process and print (and return) the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the compile happens here)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads per variant")
    parser.add_argument("--profile", action="store_true", help="report the top ops of one step per variant")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 + 1 steps, fp32, eager backend")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant (the child process)
    args, config_args = parser.parse_known_args(argv)

    if args.variant:
        v = json.loads(args.variant)
        print(json.dumps(run_variant(v["config"], v["dtype"], v["compiled"], v["steps"], v["warmup"], v["smoke"],
                                     v["profile"], v["threads"])))
        return {}

    config_args = DEFAULT_CONFIG + config_args
    dtypes = args.dtypes.split(",")
    if args.smoke:
        config_args += SMOKE_CONFIG
        args.steps, args.warmup, dtypes = 1, 1, ["float32"]
    report = {"machine": machine_info(), "config": {}, "variants": [], "gains": {}}
    from trainer.job_config import load_config

    cfg = load_config(config_args)
    report["config"] = {"model": "smoke" if args.smoke else f"{cfg.model.name}/{cfg.model.flavor}",
                        "batch": cfg.training.local_batch_size, "seq_len": cfg.training.seq_len,
                        "steps": args.steps, "warmup": args.warmup, "backend": cfg.compile.backend,
                        "threads": args.threads}
    for dtype in dtypes:
        pair = {}
        for compiled in (False, True):
            print(f"variant {dtype} compile={compiled}", file=sys.stderr)
            pair[compiled] = _spawn(dict(config=config_args, dtype=dtype, compiled=compiled, steps=args.steps,
                                         warmup=args.warmup, smoke=args.smoke, profile=args.profile,
                                         threads=args.threads))
            report["variants"].append(pair[compiled])
        eager, comp = pair[False], pair[True]
        report["gains"][dtype] = {
            "speedup": eager["step_time_s"] / comp["step_time_s"],
            "cpu_speedup": eager["step_cpu_s"] / comp["step_cpu_s"],
            "step_peak_reduction": 1 - comp["step_peak_bytes"] / eager["step_peak_bytes"],
            "steady_rss_reduction": 1 - comp["steady_peak_rss_bytes"] / eager["steady_peak_rss_bytes"],
        }
    report["machine"]["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
