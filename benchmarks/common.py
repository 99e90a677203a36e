"""Pieces shared by the benchmark scripts: machine description, profiler labels, device timing, the GPU kernel
time split, and training several jobs in one torchrun launch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine_info() -> dict:
    """CPU model, cores, torch threads and version, the load average now (other processes on a 2-core machine
    make every timing slower and noisier, so reports carry it), and the GPU (`gpu_info`) or None."""
    import torch

    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "load_average_before": os.getloadavg(), "gpu": gpu_info()}


def gpu_info() -> dict | None:
    """The CUDA device this process uses: name, memory, compute capability, CUDA and cuDNN versions of torch's
    build, and the driver (from nvidia-smi; None where it is missing). None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    driver = None
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    return {"name": props.name, "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(), "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "driver": driver}


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """A benchmark's own arguments and, after `--`, the trainer's config overrides it passes on to every run."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def labelled(name: str, fn):
    """`fn` running inside a profiler label (a no-op when no profiler is active)."""
    from torch.profiler import record_function

    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def synchronize(device) -> None:
    """Wait until `device` has finished the work queued so far (a no-op on CPU, whose ops return when done)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(dtype, device, n: int, repeats: int = 8) -> float:
    """Dense matmul peak in TFLOP/s on `device`: the best of `repeats` timed n x n x n products after warm-up,
    each timed from a device synchronisation to the next (on CUDA the launch is asynchronous)."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return _best_gemm_tflops(lambda: torch.mm(a, b), device, n, repeats)


def measure_fp8_matmul_peak(device, n: int, repeats: int = 8) -> float:
    """e4m3 matmul peak in TFLOP/s on `device`, timed as `measure_matmul_peak`: `torch._scaled_mm` of two n x n
    float8_e4m3fn operands with rowwise fp32 scales (one per row of the first, one per column of the second) and a
    bf16 output. The second operand is column-major, as cuBLAS's FP8 GEMM needs. On a CPU whose torch takes one
    scale per tensor only (2.11's oneDNN path), the scales are per tensor: the same GEMM."""
    import torch

    from quantization.fp8.kernels import Platform

    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t().contiguous().t()
    scale_a, scale_b = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    if torch.device(device).type == "cpu" and not Platform.detect("cpu").cpu_rowwise_scaled_mm:
        scale_a, scale_b = torch.ones((), device=device), torch.ones((), device=device)
    return _best_gemm_tflops(
        lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16), device, n, repeats)


def _best_gemm_tflops(gemm, device, n: int, repeats: int) -> float:
    """TFLOP/s of the fastest of `repeats` calls of `gemm()` (an n x n x n product) after two warm-up calls."""
    for _ in range(2):  # first calls: oneDNN / cuBLAS pick and cache their kernel, the GPU clocks up
        gemm()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        gemm()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


# ----------------------------------------------------------------------------------------------- GPU kernel split

KERNEL_CATEGORIES = ("gemm", "grouped_gemm", "attention", "optimizer", "casts_copies", "elementwise",
                     "communication", "memcpy", "other")

# (category, pattern searched in the demangled kernel name), first match wins. The order matters: attention
# kernels are CUTLASS kernels too, grouped GEMMs are GEMMs, casts are elementwise kernels, and inductor's own
# kernels say what they are in their prefix.
_KERNEL_RULES = [
    ("communication", re.compile(r"nccl|deep_ep|nvshmem", re.I)),
    ("memcpy", re.compile(r"^Mem(cpy|set)\b")),  # the profiler's names for copies and fills by the copy engines
    ("elementwise", re.compile(r"^triton_poi_")),  # inductor: pointwise
    ("other", re.compile(r"^triton_(per|red)_")),  # inductor: reductions (norms, softmax, sums)
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn", re.I)),
    ("grouped_gemm", re.compile(r"grouped|GroupProblemShape|ptr_array", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|FusedAdam|fused_adam|lpnorm_cleanup", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|gemv|splitKreduce|cutlass|wgmma|^triton_tem_.*mm", re.I)),
    ("casts_copies", re.compile(r"copy_kernel|CatArrayBatchedCopy", re.I)),
    ("elementwise", re.compile(r"elementwise_kernel", re.I)),
]


def kernel_category(name: str) -> str:
    """The category of a CUDA kernel (or copy engine activity) by its demangled name; one of KERNEL_CATEGORIES.

    gemm: cuBLAS/cuBLASLt (`sm90_xmma_gemm_*`, `nvjet_*`, split-K reduce) and CUTLASS GEMMs; grouped_gemm:
    `torch._grouped_mm`'s CUTLASS grouped kernels and inductor's grouped templates; attention: flash,
    memory-efficient (`fmha_cutlass*`) and cuDNN SDPA kernels; optimizer: the multi-tensor kernels of fused/foreach
    AdamW and of gradient-norm clipping; casts_copies: copy kernels, which do dtype casts and layout copies alike
    (their names do not say which); elementwise: the other pointwise kernels; communication: NCCL, DeepEP,
    NVSHMEM; memcpy: host/device copies and memsets; other: reductions, norms, softmax, sort, index, embedding,
    loss.
    """
    for category, pattern in _KERNEL_RULES:
        if pattern.search(name):
            return category
    return "other"


def busy_seconds(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of the union of `intervals` (start, end) clipped to `window`: the time at least one runs."""
    lo, hi = window
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    busy, cur_start, cur_end = 0.0, None, None
    for s, e in clipped:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy


def gpu_time_split(kernels: list[tuple[str, float, float]], window: tuple[float, float], top: int = 40) -> dict:
    """Kernel time of one step by category, and the GPU's idle time.

    `kernels`: (name, start_s, end_s) of every kernel and copy the profiler saw on the device; `window`: the step's
    (start_s, end_s) on the same clock, from a device synchronisation to the next, so every kernel of the step lies
    inside. idle_s is the part of the window where no kernel runs: the GPU waits for the host (launch overhead,
    Python, host syncs). Kernels on several streams can overlap, so the categories can add up to more than busy_s.
    `top` kernels by time are listed by name (40: at the 671B shapes with FP8 the 15 largest left half of the
    quantisation's time unnamed).
    """
    lo, hi = window
    inside = [(n, max(s, lo), min(e, hi)) for n, s, e in kernels if e > lo and s < hi]
    seconds = dict.fromkeys(KERNEL_CATEGORIES, 0.0)
    per_name: dict[str, list] = {}
    for name, s, e in inside:
        seconds[kernel_category(name)] += e - s
        entry = per_name.setdefault(name, [0.0, 0])
        entry[0] += e - s
        entry[1] += 1
    step = hi - lo
    busy = busy_seconds([(s, e) for _, s, e in inside], window)
    rows = sorted(per_name.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {
        "step_s": step,
        "busy_s": busy,
        "idle_s": step - busy,
        "kernel_s": seconds,
        "share_of_step": {**{k: v / step for k, v in seconds.items()}, "idle": (step - busy) / step},
        "kernels": len(inside),
        "top_kernels": [{"name": name[:200], "category": kernel_category(name), "ms": round(t * 1e3, 3),
                         "count": count} for name, (t, count) in rows],
    }


def torchrun_jobs(script: str, jobs: dict[str, list[str]], ranks: int, tmp: str,
                  timeout_s: int) -> dict[str, list[dict]]:
    """Train every job (name -> trainer args) on `ranks` gloo ranks in one torchrun launch of `script --worker
    JOBS OUT`, whose worker calls `serve_jobs`: one launch instead of one per job. Returns each job's results, one
    per rank in rank order."""
    jobs_file, out_dir = os.path.join(tmp, f"jobs{ranks}.json"), os.path.join(tmp, f"out{ranks}")
    os.makedirs(out_dir, exist_ok=True)
    with open(jobs_file, "w") as f:
        json.dump(jobs, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           os.path.abspath(script), "--worker", jobs_file, out_dir]
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{r.stderr[-4000:]}")
    results = {}
    for name in jobs:
        results[name] = []
        for rank in range(ranks):
            with open(os.path.join(out_dir, f"{name}.rank{rank}.json")) as f:
                results[name].append(json.load(f))
    return results


def print_row(row: dict, rows: list[dict]) -> None:
    """Print one result row as a JSON line, with the machine it ran on, and append it to `rows`."""
    row["machine"] = machine_info()
    print(json.dumps(row), flush=True)
    rows.append(row)


def help_or_worker(argv: list[str], doc: str, train: Callable[[list[str]], dict], timeout_s: int = 300) -> bool:
    """The start every `torchrun_jobs` benchmark's CLI shares: with -h / --help prints `doc` and returns True (nothing
    more to do); as `--worker JOBS OUT` (what `torchrun_jobs` starts) serves this rank's jobs through `train` and
    ends the process; otherwise returns False."""
    if "-h" in argv or "--help" in argv:
        print(doc)
        return True
    if argv[:1] == ["--worker"]:
        serve_jobs(argv[1], argv[2], train, timeout_s=timeout_s)
    return False


def jobs_benchmark_cli(argv: list[str], doc: str, train: Callable[[list[str]], dict], run_benchmark: Callable,
                       default_steps: int = 4) -> None:
    """The CLI of a benchmark that trains pairs of jobs through `torchrun_jobs`: -h / --help and the worker
    (`help_or_worker`), else `run_benchmark(smoke=, steps=, extra=)` from `--smoke`, `--steps N` (default
    `default_steps`) and the trainer overrides after `--`. The trainer's per-step log lines would bury the JSON rows:
    its INFO lines are off, in the workers too."""
    import logging

    logging.disable(logging.INFO)
    if help_or_worker(argv, doc, train):
        return
    own, extra = split_passthrough(argv)
    steps = int(own[own.index("--steps") + 1]) if "--steps" in own else default_steps
    run_benchmark(smoke="--smoke" in own, steps=steps, extra=extra)


def serve_jobs(jobs_file: str, out_dir: str, train: Callable[[list[str]], dict], timeout_s: int) -> NoReturn:
    """The torchrun worker of `torchrun_jobs`: one process group, one torch thread per rank, every job in turn;
    `train(args)` returns this rank's result (JSON), written to OUT as `<job>.rank<r>.json`; the ranks start each
    job together. Ends the process (exit 0) when done: the process group may outlive its shutdown
    (`trainer.device.end_process`)."""
    import torch
    import torch.distributed as dist

    from trainer import device as devices

    torch.set_num_threads(1)
    devices.init_distributed(timeout_s=timeout_s)
    try:
        with open(jobs_file) as f:
            jobs = json.load(f)
        for name, args in jobs.items():
            result = train(args)
            with open(os.path.join(out_dir, f"{name}.rank{dist.get_rank()}.json"), "w") as f:
                json.dump(result, f)
            dist.barrier()
    finally:
        devices.shutdown_distributed()
    devices.end_process(0)
