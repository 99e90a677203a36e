"""Training throughput of one process (or of each rank under torchrun) against the device's own matmul peak:
tokens/s, TFLOP/s, MFU, time split (communication included) and, on CUDA, where the GPU's time goes.

    python benchmarks/throughput.py --config train_configs/cpu_bench.toml              # 10 timed steps after 2
    python benchmarks/throughput.py --config train_configs/h100_bench.toml             # one GPU, 16B shapes
    python benchmarks/throughput.py --config train_configs/debug_model.toml --training.seq_len 256 \\
        --training.local_batch_size 4 --memory.track off --training.dtype bfloat16      # + any trainer flag
    python benchmarks/throughput.py --smoke                                             # tiny run: what the tests run
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/throughput.py \\
        --smoke --parallelism.expert_parallel_degree 2                                  # 2 gloo ranks, EP 2

The steps are the trainer's own (`trainer.train.Trainer.train`: data loader, forward, backward, grad clipping,
AdamW, LR schedule, MoE bias update, memory tracking as configured), on the device the trainer chooses
(`trainer.device`: cuda:LOCAL_RANK when CUDA is present, else the CPU). Run directly, it is one process without a
process group, so communication is 0. Under torchrun (RANK in the environment) every rank joins the process group
(`trainer.device.init_distributed`) and trains its part of the job with the degrees of `[parallelism]`, exactly as
`trainer.train` would; only rank 0 prints the report, and the other ranks' logs go to stderr. Forced for the
benchmark: tensorboard, validation and checkpointing off, outputs in a temporary folder, `training.steps` =
warm-up + timed + free-running + 1 profiled step. Each timed step is timed from a device synchronisation before it
to one after it (on CUDA a step's kernels may still run when `train_step` returns); the free-running steps are
timed together, with no synchronisation between them, as training runs; the time split comes from the separately
profiled last step.

Output: one JSON object on stdout (the trainer's log on stderr); under torchrun the numbers are rank 0's unless
said otherwise:
  machine     CPU model, cores, torch threads, torch version, load average before and after (other processes on
              the machine make every number slower and noisier); gpu: name, memory, compute capability, count,
              torch's CUDA and cuDNN versions, driver (from nvidia-smi), or null without CUDA
  config      model flavor, n_layers, params, dtype, batch (per rank), seq_len, steps, warm-up, compile,
              activation_checkpoint mode, memory.track, FLOPs per token (`models/deepseek_v3/flops.py`: 6 x active
              matmul params + causal attention), device, gemm_n, float32_matmul_precision (torch's: "highest" =
              no TF32), single_process (false under torchrun), world_size, parallel_degrees {dp_replicate,
              dp_shard, ep, pp}, fp8_recipe (`fp8.recipe`), fp8_flops_per_token (the part of FLOPs per token that
              the recipe runs as FP8 GEMMs: that of the modules the `[fp8]` filters select, from the model spec's
              per-module table `module_flops`; 0 for recipe none; null for a model without the table) and
              fp8_flops_share (its share of FLOPs per token)
  tokens_per_s            per rank, at the median step time (each step timed between two synchronisations)
  free_running            steps, seconds, tokens_per_s, mfu of `--steps` further steps timed as training runs
                          them: one device synchronisation before the first and one after the last, none
                          between (the host launches the next step while the device runs this one; the loop's
                          bookkeeping between steps counts). On CUDA the gap to tokens_per_s is the device's idle
                          time that the per-step synchronisations add
  aggregate_tokens_per_s  the job's tokens/s: the sum over ranks of each rank's tokens/s at its own median step
                          time (divided by pp, since the stages of a pipeline share their tokens); gathered with
                          a collective after the timed steps. Equals tokens_per_s in one process
  rank_step_time_s        every rank's median step time, by rank
  step_time_s         median, min, max over the timed steps; all: every timed step
  model_tflops        tokens_per_s x FLOPs per token / 1e12
  gemm_peak_tflops    {bfloat16, float32[, float8_e4m3fn]}: the device's dense matmul peak measured by this script in
                      this process after training: best of 8 n x n x n GEMMs, each timed between device
                      synchronisations (n = gemm_n: 2048 on CPU, 8192 on CUDA, 512 with --smoke); on CPU with the
                      training's thread count; under torchrun every rank measures at the same time, so it is one
                      process's peak while the other ranks load the other cores (or GPUs), as in training.
                      float8_e4m3fn only with an FP8 recipe: `torch._scaled_mm` of e4m3 operands with rowwise fp32
                      scales and a bf16 output
  peak_tflops         gemm_peak_tflops of the training dtype
  mfu                 model_tflops / peak_tflops: every FLOP against the compute dtype's peak
  mfu_recipe          with an FP8 recipe (else null): tokens_per_s x (fp8_flops_per_token / FP8 peak + the other
                      FLOPs per token / peak_tflops) / 1e12, the share of a second that a second's tokens would take
                      at the measured peaks, their FP8 GEMMs at the float8_e4m3fn one; null if fp8_flops_per_token
                      is. Which kernel runs each FP8 GEMM is `quantization/fp8/kernels.py`'s choice, logged at
                      start: on sm90 real FP8 kernels (scaled_mm, _scaled_grouped_mm, per-expert scaled_mm or
                      DeepGEMM); elsewhere the emulation, which multiplies the dequantised operands in the compute
                      dtype: for it mfu says how far the step is from what the emulation can run at, mfu_recipe how
                      far from an FP8 machine's limit
  peak_memory_bytes   the highest per-step peak of tensor memory over the timed steps: the trainer's exact tracker
                      (parameters, gradients, optimizer state, activations) when it is exact, else on CUDA the
                      caching allocator's peak allocated bytes; null on CPU without the exact tracker
  allocator           CUDA only (null on CPU): peak_allocated_bytes and peak_reserved_bytes, the highest of each
                      step's torch.cuda.max_memory_allocated / max_memory_reserved over the timed steps
  time_split_s        host time of one profiled step (after the timed ones) by phase: data, forward, backward,
  time_split_share    optimizer, communication, other; and each phase's share of the step. On CUDA this is the
                      host thread's time (launching kernels, waiting for the device), not the GPU's
  gpu_time_split      CUDA only (null on CPU): the profiled step on the GPU, from a device synchronisation to the
                      next (step_s): kernel_s, the kernel time by category (gemm, grouped_gemm, attention,
                      optimizer, casts_copies, elementwise, communication, memcpy, other; the classifier is
                      `benchmarks.common.kernel_category`), busy_s (the union of all kernels), idle_s (step_s -
                      busy_s: the GPU waits for the host, e.g. launch overhead, Python, host syncs), share_of_step
                      (each category and idle over step_s), kernels (count), top_kernels, and phase_kernel_s:
                      the kernel time by phase of the host op that launched it (data, forward, backward,
                      optimizer, communication, other; an activation-checkpoint recompute runs in backward), so
                      the cost of AC is (step time with AC - without) / forward kernel time without;
                      idle_by_host: the idle time charged to what the host was doing (`idle_by_host`): by phase
                      of the op whose launch ended each gap (plus device, step_end, unlinked), gap counts, the
                      top (phase, launching op) pairs and the 5 longest gaps with their host path. The profiler
                      adds host time to every op, so the profiled step idles more than a free-running one
  top_ops             the ops with the most self CPU time in the profiled step
  compile_time        compiles (torch.compile graphs, a backward counted apart) and seconds: their wall time in this
                      process (`trainer.compile_times`; each is also a line of the trainer's log); 0 and 0.0 when
                      nothing compiled
  time_budget         the profiled step against the measured peak (deepseek_v3 models): for "matmul" (mm, addmm,
                      grouped_mm, scaled_mm: the parameter matmuls) and "attention" (bmm and softmax of SDPA's math path, or
                      the flash kernels), measured_s, at_peak_s (their model FLOPs / peak) and efficiency (at_peak_s
                      / measured_s); rest_s (everything else); step_at_peak_s (all model FLOPs / peak) and
                      profiled_step_s. measured_s is self CPU time of those ops on CPU, and on CUDA the kernel time
                      of gemm + grouped_gemm and of attention, with profiled_step_s = gpu_time_split's step_s. It
                      says where MFU is lost: GEMMs below peak, attention, or work with no model FLOPs

Time split method: one `torch.profiler` pass (CPU activity, plus CUDA activity on CUDA) over one step, entered
through the trainer's `around_step` hook. The trainer labels its phases with `record_function` itself: reading the
batch ("data"), the forward and the loss ("forward"; with pipeline parallelism the whole schedule, whose backward
nodes still count as backward), and clipping, the optimizer step and the MoE bias update ("optimizer");
torch.optim labels its own `step` and `zero_grad` ("optimizer"), and the autograd engine labels every backward
node it runs ("backward"). Every profiled event's self CPU time goes to the phase of its
innermost labelled ancestor; "communication" wins wherever it runs: collective ops (`c10d::*`, the functional
collectives `_c10d_functional::*` with their `wait_tensor`, which is where the expert-parallel all-to-all blocks,
and `gloo:*`/`nccl:*`), and `Work.wait()`, which the benchmark labels during the profiled step because the blocking
part of FSDP's all-gather and reduce-scatter and of the trainer's all-reduces is a Python call to it, invisible to
the profiler otherwise (gloo launches return at once; the copies run on gloo's worker threads). The rest (loss
bookkeeping, `.item()` syncs, the LR schedule, the metric logger) is "other". Only the thread that runs the step
counts (not gloo's workers, which copy while it waits; intra-op threads record no events), so the split is a split
of its wall time; on CUDA the autograd engine's device thread, which runs backward while the caller waits, counts
too.
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
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402  (needs the repo root on sys.path)
    gpu_time_split, labelled, machine_info, measure_fp8_matmul_peak, measure_matmul_peak, synchronize)
from core.config import run_with_config_errors  # noqa: E402

SMOKE_CONFIG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32",
                "--training.local_batch_size", "2", "--memory.track", "exact"]
# --smoke: the debug flavor cut to 2 layers at width 64, so the tests' run takes seconds on a busy machine
SMOKE_ARGS = dict(n_layers=2, dim=64, inter_dim=128, moe_inter_dim=32, n_heads=2, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
PHASES = ("data", "forward", "backward", "optimizer", "communication", "other")
# the FP8 recipes' real kernels (quantization/fp8/scaled_gemms.py, torchao's rowwise linears) count as matmuls
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::_grouped_mm", "aten::_scaled_mm", "aten::_scaled_mm_v2",
              "aten::_scaled_grouped_mm"}
# the model's only bmm is SDPA's math path (q.k^T and p.v, forward and backward)
ATTENTION_OPS = {"aten::bmm", "aten::_softmax", "aten::_safe_softmax", "aten::_softmax_backward_data",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
COMM_PREFIXES = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")
STEP_LABEL = "benchmark/profiled_step"
# the host's calls that put work on a CUDA device: the runtime's (cudaLaunchKernel, cudaMemcpyAsync, ...) and the
# driver's (cuLaunchKernel, cuLaunchKernelEx: triton's launches)
LAUNCH_PREFIX = "cu"
GEMM_N = {"cpu": 2048, "cuda": 8192}  # large enough to reach the device's GEMM peak, small enough to time quickly


def _phase_of(name: str) -> str | None:
    """The phase an event's name opens, or None if it opens none."""
    if name.startswith(COMM_PREFIXES):
        return "communication"
    if name.startswith("phase/"):
        return name[len("phase/"):]
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith("Optimizer."):
        return "optimizer"
    return None


def _step_thread_events(events) -> list:
    """The host events of the threads that ran the step: the one that called it and, on CUDA, the autograd
    engine's device thread, which runs backward while the caller waits. gloo's worker threads copy while the step
    waits, so their time is not step time (the wait is); device events (CUDA kernels) are not host time."""
    from torch.autograd import DeviceType

    step_thread = next(e.thread for e in events if e.name.startswith("phase/"))
    threads = {step_thread} | {e.thread for e in events if e.name.startswith("autograd::engine::evaluate_function")}
    return [e for e in events if e.thread in threads and e.device_type == DeviceType.CPU]


def _phase_of_event(event) -> str:
    """The phase of a host event: that of its innermost labelled ancestor, except that communication wins."""
    phase, node = None, event
    while node is not None and phase != "communication":
        own = _phase_of(node.name)
        if own == "communication" or (own is not None and phase is None):
            phase = own
        node = node.cpu_parent
    return phase or "other"


def time_split(events) -> dict[str, float]:
    """Self CPU seconds per phase of the step threads' events (see `_phase_of_event`)."""
    split = dict.fromkeys(PHASES, 0.0)
    for event in _step_thread_events(events):
        split[_phase_of_event(event)] += event.self_cpu_time_total / 1e6
    return split


def phase_kernel_seconds(events) -> dict[str, float]:
    """Device kernel seconds per phase: each kernel counts for the phase of the host op that launched it (an
    activation-checkpoint recompute is launched in backward, so it counts there). The profiler also links the GPU
    side of `record_function` ranges to their host events: those are not kernels and are left out."""
    kernels = {name for name, _, _ in device_kernels(events)}
    split = dict.fromkeys(PHASES, 0.0)
    for event in _step_thread_events(events):
        launched = [k.duration for k in event.kernels if k.name in kernels] if not event.is_user_annotation else []
        if launched:
            split[_phase_of_event(event)] += sum(launched) / 1e6
    return split


def _launches(events) -> dict:
    """The host's CUDA runtime and driver calls (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...) by id:
    the profiler gives each the id of the kernel or copy it put on the device, and hangs it under the op that made
    it (on that op's thread)."""
    from torch.autograd import DeviceType

    return {e.id: e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(LAUNCH_PREFIX)}


def _host_path(event) -> str:
    """`event`'s labelled ancestors and ops from the outermost below the step label down to it, ' > '-joined."""
    names = []
    while event is not None and event.name != STEP_LABEL:
        names.append(event.name[:80])
        event = event.cpu_parent
    return " > ".join(reversed(names))


def idle_by_host(events, window: tuple[float, float], top: int = 10) -> dict:
    """Where the GPU's idle time in the profiled step goes, by what the host was doing.

    The gaps are those of `gpu_time_split` (the union of every stream's kernels inside `window`), and each is
    charged to the kernel that ends it. If that kernel's launch (the runtime call with its id, `_launches`) had not
    returned when the gap began, the GPU waited for the host to launch it: the gap goes to the launching op's phase
    (as `time_split` finds it) and name. If the launch had returned, the kernel was queued and the device waited on
    something else (another stream, an event, or its own latency between kernels): "device". The time after the
    last kernel is "step_end" (the host's bookkeeping up to the closing synchronisation); a kernel without a launch
    in the profile counts as "unlinked".

    Returns by_phase_s (PHASES plus those three), gaps (count, and over 100 us and over 1 ms), by_op (the `top`
    (phase, launching op) pairs by total gap time: ms and gap count) and largest (the 5 longest gaps: ms, phase and
    the host path of their launch, `_host_path`).
    """
    lo, hi = window
    inside = [e for e in _kernel_events(events) if e.time_range.end / 1e6 > lo and e.time_range.start / 1e6 < hi]
    kernels = sorted(inside, key=lambda e: e.time_range.start)
    launches = _launches(events)
    by_phase = dict.fromkeys(PHASES + ("device", "step_end", "unlinked"), 0.0)
    by_op: dict[tuple[str, str], list] = {}
    gaps = []
    cursor = lo
    for kernel in kernels:
        start = kernel.time_range.start / 1e6
        if start > cursor:
            launch = launches.get(kernel.id)
            if launch is None:
                phase, op, path = "unlinked", kernel.name[:80], ""
            else:
                maker = launch.cpu_parent or launch
                phase = "device" if launch.time_range.end / 1e6 < cursor else _phase_of_event(launch)
                op, path = maker.name[:80], _host_path(maker)
            gap = start - cursor
            by_phase[phase] += gap
            entry = by_op.setdefault((phase, op), [0.0, 0])
            entry[0] += gap
            entry[1] += 1
            gaps.append((gap, phase, path))
        cursor = max(cursor, kernel.time_range.end / 1e6)
    if hi > cursor:
        by_phase["step_end"] += hi - cursor
    ranked = sorted(by_op.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {
        "by_phase_s": by_phase,
        "gaps": {"count": len(gaps), "over_100us": sum(g > 1e-4 for g, _, _ in gaps),
                 "over_1ms": sum(g > 1e-3 for g, _, _ in gaps)},
        "by_op": [{"phase": phase, "op": op, "ms": round(seconds * 1e3, 3), "gaps": count}
                  for (phase, op), (seconds, count) in ranked],
        "largest": [{"ms": round(g * 1e3, 3), "phase": phase, "path": path}
                    for g, phase, path in sorted(gaps, key=lambda t: t[0], reverse=True)[:5]],
    }


def host_op_seconds(events) -> tuple[dict[str, float], float]:
    """Self CPU seconds of the step thread's matmul and attention ops, and of all its events (CPU steps)."""
    measured = {"matmul": 0.0, "attention": 0.0}
    total = 0.0
    for event in _step_thread_events(events):
        seconds = event.self_cpu_time_total / 1e6
        total += seconds
        kind = "matmul" if event.name in MATMUL_OPS else "attention" if event.name in ATTENTION_OPS else None
        if kind:
            measured[kind] += seconds
    return measured, total


def _kernel_events(events) -> list:
    """The profiled events of every CUDA kernel and copy; not the GPU-side copies of `record_function` ranges (user
    annotations), which span kernels rather than run any."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def device_kernels(events) -> list[tuple[str, float, float]]:
    """(name, start_s, end_s) of every CUDA kernel and copy in the profiled events (`_kernel_events`)."""
    return [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in _kernel_events(events)]


def step_window(events) -> tuple[float, float]:
    """(start_s, end_s) of the profiled step: the host's STEP_LABEL range, which begins and ends with a device
    synchronisation, so every kernel of the step lies inside."""
    from torch.autograd import DeviceType

    label = next(e for e in events if e.name == STEP_LABEL and e.device_type == DeviceType.CPU)
    return label.time_range.start / 1e6, label.time_range.end / 1e6


def time_budget(measured: dict[str, float], total: float, cfg, tokens: int, peak_tflops: float) -> dict | None:
    """Matmul and attention time of the profiled step (`measured`, out of `total` seconds) against their model
    FLOPs at the measured peak."""
    from models.deepseek_v3.flops import attention_flops_per_token, count_params
    from trainer.job_config import model_job
    from trainer.registry import get_model_spec

    if cfg.model.name != "deepseek_v3":
        return None
    args = get_model_spec(cfg.model.name).build_args(model_job(cfg))
    counts = count_params(args)
    flops = {"matmul": 6.0 * (counts.active - counts.embedding) * tokens,
             "attention": attention_flops_per_token(args, cfg.training.seq_len) * tokens}
    budget = {}
    for kind, f in flops.items():
        at_peak = f / (peak_tflops * 1e12)
        budget[kind] = {"measured_s": measured[kind], "at_peak_s": at_peak,
                        "efficiency": at_peak / measured[kind] if measured[kind] else None}
    budget["rest_s"] = total - sum(measured.values())
    budget["step_at_peak_s"] = sum(flops.values()) / (peak_tflops * 1e12)
    budget["profiled_step_s"] = total
    return budget


def run(config_args: list[str], steps: int, warmup: int, gemm_n: int | None) -> dict | None:
    """Train `warmup + 2 steps + 1` steps with the trainer in this process (one rank of the job under torchrun)
    and measure them: `steps` timed one by one, `steps` free-running, one profiled; returns the report on rank 0,
    None on the other ranks. `gemm_n`: the size of the peak's GEMMs (None: GEMM_N of the device)."""
    import torch
    import torch.distributed as dist
    from quantization.fp8.accounting import fp8_flops_per_token
    from quantization.fp8.config import fp8_selection
    from torch.profiler import ProfilerActivity, profile, record_function
    from trainer import device as devices
    from trainer.job_config import load_config
    from trainer.train import Trainer, prepare

    total = warmup + 2 * steps + 1
    free_first, free_last = warmup + steps + 1, warmup + 2 * steps
    distributed = "RANK" in os.environ
    world_size, rank = devices.world_size_from_env(), int(os.environ.get("RANK", 0))
    with tempfile.TemporaryDirectory(prefix="throughput_") as out:
        cfg = load_config(config_args + [
            "--job.dump_folder", out, "--training.steps", str(total), "--metrics.enable_tensorboard", "false",
            "--metrics.log_freq", str(total), "--validation.enable", "false", "--checkpoint.enable", "false"])
        # as trainer.train.run: every check on the config before the process group exists
        prep = prepare(cfg, world_size, rank)
        # the trainer's choice: cuda:LOCAL_RANK when CUDA is present, else the CPU; a process group only under
        # torchrun
        device = devices.init_distributed()
        cuda = device.type == "cuda"
        machine = machine_info()
        gemm_n = gemm_n or GEMM_N[device.type]
        try:
            trainer = Trainer(prep, device)
            profiled_step, prof_box = total, []
            step_times, allocator_peaks, free_running = [], [], []
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

            @contextlib.contextmanager
            def timed(step: int):
                # from one device synchronisation to the next: on CUDA the step's kernels may still run when
                # train_step returns
                synchronize(device)
                t0 = time.perf_counter()
                yield
                synchronize(device)
                step_times.append(time.perf_counter() - t0)
                if cuda:  # the step's own peaks: the trainer's monitor resets them at every step end
                    allocator_peaks.append((torch.cuda.max_memory_allocated(device),
                                            torch.cuda.max_memory_reserved(device)))

            @contextlib.contextmanager
            def free(step: int):
                # as training runs: one synchronisation before the first of these steps and one after the last, so
                # the host launches a step while the device still runs the one before
                if step == free_first:
                    synchronize(device)
                    free_running.append(time.perf_counter())
                yield
                if step == free_last:
                    synchronize(device)
                    free_running.append(time.perf_counter())

            @contextlib.contextmanager
            def profiled(step: int):
                # the trainer labels data, forward and optimizer itself; waiting on a collective is labelled here
                with profile(activities=activities) as prof, \
                        mock.patch.object(dist.Work, "wait", labelled("phase/communication", dist.Work.wait)), \
                        record_function(STEP_LABEL):
                    synchronize(device)
                    yield
                    synchronize(device)
                prof_box.append(prof)

            history: list[dict] = []
            try:
                trainer.train(history, around_step=lambda step: (
                    profiled if step == profiled_step else free if step >= free_first else timed)(step))
            finally:
                trainer.close()

            # this rank's tokens per optimizer step, gradient accumulation included
            global_batch = cfg.training.global_batch_size
            per_rank_batch = (global_batch // trainer.dims.dp if global_batch != -1
                              else cfg.training.local_batch_size)
            tokens_per_step = per_rank_batch * cfg.training.seq_len
            times = step_times[warmup:warmup + steps]
            median = statistics.median(times)
            rank_medians = [median]
            if distributed:  # after the timed steps, so the gather does not slow them
                rank_medians = [None] * world_size
                dist.all_gather_object(rank_medians, median)
            dtype = torch.bfloat16 if cfg.training.dtype == "bfloat16" else torch.float32
            # every rank right after the gather: one process's peak while the others load the other cores, as in
            # training (and as in independent runs sharing the machine)
            gemm_peaks = {str(d).removeprefix("torch."): measure_matmul_peak(d, device, gemm_n)
                          for d in (torch.bfloat16, torch.float32)}
            if cfg.fp8.recipe != "none":  # plain runs skip it: only FP8 GEMMs are measured against it
                gemm_peaks["float8_e4m3fn"] = measure_fp8_matmul_peak(device, gemm_n)
            peak = gemm_peaks[str(dtype).removeprefix("torch.")]
        finally:
            devices.shutdown_distributed()
    if rank != 0:
        return None

    tokens_per_s = tokens_per_step / median
    free_seconds = free_running[1] - free_running[0]
    free_tokens_per_s = steps * tokens_per_step / free_seconds
    flops = trainer.flops_per_token
    model_tflops = tokens_per_s * flops / 1e12
    module_flops = trainer.spec.tools.module_flops
    selection = fp8_selection(cfg.fp8, trainer.spec.plan.module_defaults)
    fp8_flops = fp8_flops_per_token(selection, module_flops(trainer.model_args)) if module_flops else None
    mfu_recipe = None
    if cfg.fp8.recipe != "none" and fp8_flops is not None:
        mfu_recipe = tokens_per_s * (fp8_flops / gemm_peaks["float8_e4m3fn"] + (flops - fp8_flops) / peak) / 1e12
    dims = trainer.dims
    # the stages of one pipeline feed the same tokens: count them once
    aggregate = sum(tokens_per_step / t for t in rank_medians) / dims.pp

    peak_memory, allocator = None, None
    if trainer.memory.mode == "exact":
        peak_memory = int(max(h["memory/peak_allocated_GiB"] for h in history[warmup:warmup + steps]) * 2**30)
    if cuda:
        timed_peaks = allocator_peaks[warmup:warmup + steps]
        allocator = {"peak_allocated_bytes": max(a for a, _ in timed_peaks),
                     "peak_reserved_bytes": max(r for _, r in timed_peaks)}
        peak_memory = peak_memory or allocator["peak_allocated_bytes"]
    flavor = "hf_config" if cfg.model.hf_config_path else cfg.model.flavor
    prof = prof_box[0]
    events = prof.events()
    split = time_split(events)
    split_total = sum(split.values())
    gpu_split = None
    if cuda:
        window = step_window(events)
        gpu_split = gpu_time_split(device_kernels(events), window)
        gpu_split["phase_kernel_s"] = phase_kernel_seconds(events)
        gpu_split["idle_by_host"] = idle_by_host(events, window)
    if cuda:  # the device's time: kernels, and the step from synchronisation to synchronisation
        kernel_s = gpu_split["kernel_s"]
        measured = {"matmul": kernel_s["gemm"] + kernel_s["grouped_gemm"], "attention": kernel_s["attention"]}
        budget_total = gpu_split["step_s"]
    else:
        measured, budget_total = host_op_seconds(events)
    rows = sorted(prof.key_averages(), key=lambda r: r.self_cpu_time_total, reverse=True)[:15]
    machine["load_average_after"] = os.getloadavg()
    return {
        "machine": machine,
        "config": {"model": f"{cfg.model.name}/{flavor}", "n_layers": trainer.model_args.n_layers,
                   "dtype": cfg.training.dtype, "batch": cfg.training.local_batch_size,
                   "seq_len": cfg.training.seq_len, "steps": steps, "warmup": warmup, "compile": cfg.compile.enable,
                   "activation_checkpoint": cfg.activation_checkpoint.mode, "memory_track": trainer.memory.mode,
                   "flops_per_token": flops, "params": trainer.total_params, "fp8_recipe": cfg.fp8.recipe,
                   "fp8_flops_per_token": fp8_flops,
                   "fp8_flops_share": fp8_flops / flops if fp8_flops is not None else None,
                   "device": str(device), "gemm_n": gemm_n,
                   "float32_matmul_precision": torch.get_float32_matmul_precision(),
                   "single_process": not distributed, "world_size": dims.world_size,
                   "parallel_degrees": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "ep": dims.ep,
                                        "pp": dims.pp}},
        "tokens_per_s": tokens_per_s,
        "free_running": {"steps": steps, "seconds": free_seconds, "tokens_per_s": free_tokens_per_s,
                         "mfu": free_tokens_per_s * flops / 1e12 / peak},
        "aggregate_tokens_per_s": aggregate,
        "rank_step_time_s": rank_medians,
        "step_time_s": {"median": median, "min": min(times), "max": max(times), "all": times},
        "model_tflops": model_tflops,
        "peak_tflops": peak,
        "gemm_peak_tflops": gemm_peaks,
        "mfu": model_tflops / peak,
        "mfu_recipe": mfu_recipe,
        "peak_memory_bytes": peak_memory,
        "allocator": allocator,
        "time_split_s": split,
        "time_split_share": {k: v / split_total for k, v in split.items()},
        "gpu_time_split": gpu_split,
        "time_budget": time_budget(measured, budget_total, cfg, tokens_per_step, peak),
        "compile_time": {"compiles": trainer.compile_times.compiles, "seconds": trainer.compile_times.seconds},
        "top_ops": [{"name": r.key, "self_cpu_ms": round(r.self_cpu_time_total / 1e3, 3), "count": r.count}
                    for r in rows],
    }


def _smoke_model_config(folder: str) -> str:
    """Write the --smoke model as a HF config.json in `folder` (the config system's way to a custom size)."""
    from models.deepseek_v3.args import FLAVORS
    from models.deepseek_v3.hf import hf_config_from_args

    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        json.dump(hf_config_from_args(FLAVORS["debugmodel"].replace(**SMOKE_ARGS)), f)
    return path


def main(argv: list[str] | None = None) -> dict | None:
    """Parse the flags, run the benchmark and print (and return) the JSON report; under torchrun only rank 0
    prints and returns it (None elsewhere)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="training TOML (as --job.config_file)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocator, caches, compile)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model at seq 32 x batch 2, 1 warm-up + 2 timed steps")
    args, config_args = parser.parse_known_args(argv)
    if args.config:
        config_args = ["--job.config_file", args.config] + config_args
    gemm_n = None
    # the trainer's log is progress: keep stdout for the one JSON object
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory(prefix="throughput_smoke_") as tmp:
        from trainer.metrics import init_logging

        if args.smoke:
            config_args = SMOKE_CONFIG + ["--model.hf_config_path", _smoke_model_config(tmp)] + config_args
            args.steps, args.warmup, gemm_n = 2, 1, 512
        init_logging(int(os.environ.get("RANK", 0)))
        report = run(config_args, args.steps, args.warmup, gemm_n)
    if report is not None:
        print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    from trainer import device as devices

    run_with_config_errors(main)  # a bad config or flag: one line, exit code 2
    devices.end_process(0)  # the process group may outlive its shutdown (see there)
