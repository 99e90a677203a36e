"""The throughput benchmarks' reports: `benchmarks/throughput.py --smoke` (one process, on the device the trainer
would choose) and `benchmarks/scaling.py --smoke` (independent processes, then throughput.py on 2 gloo ranks with
EP 2) run and print the documented schema; the CUDA kernel classifier and the GPU time split of
`benchmarks/common.py` against recorded kernel names and hand-made intervals.

Of the reports, the run each describes (degrees, batch, steps) and every derived number (tokens/s, TFLOP/s, MFU,
shares, budget) recomputed from its raw timings are checked; the timings themselves never are: they depend on the
machine and on what else runs on it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch._dynamo.callback import CallbackTrigger, callback_handler

from benchmarks.common import KERNEL_CATEGORIES, busy_seconds, gpu_time_split, kernel_category
from benchmarks.throughput import SMOKE_ARGS
from models.deepseek_v3.args import FLAVORS
from models.deepseek_v3.flops import attention_flops_per_token, block_flops_per_token
from models.deepseek_v3.hf import hf_config_from_args
from trainer.compile_times import CompileTimes

REPO = Path(__file__).resolve().parent.parent
PHASES = ("data", "forward", "backward", "optimizer", "communication", "other")


def _run_json(script: str, timeout: float, *flags: str) -> dict:
    r = subprocess.run([sys.executable, script, "--smoke", *flags], cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)  # stdout holds exactly one JSON object


@contextlib.contextmanager
def _log_of(path: Path):
    """The trainer's log lines at INFO and above into `path` while inside."""
    logger, handler = logging.getLogger("trainer"), logging.FileHandler(path)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(level)


def _fake_compile(clock: list[float], trigger: CallbackTrigger, seconds: float) -> None:
    """A compile as torch reports it to its callbacks, `seconds` long on the fake `clock`."""
    with callback_handler.install_callbacks(trigger, "0/0"):
        clock[0] += seconds


def check_throughput_report(report: dict, world_size: int, ep: int, memory_track: str) -> None:
    """One throughput.py --smoke report (of rank 0 under torchrun): the run it describes and its derived numbers
    recomputed from its raw timings (the definitions in the benchmark's docstring)."""
    config = report["config"]
    cuda = config["device"].startswith("cuda")
    assert (report["machine"]["gpu"] is not None) is cuda
    assert config["gemm_n"] == 512 and config["n_layers"] == 2 and config["params"] > 0
    assert config["single_process"] is (world_size == 1)
    assert config["world_size"] == world_size
    assert config["parallel_degrees"] == {"dp_replicate": 1, "dp_shard": world_size, "ep": ep, "pp": 1}
    assert (config["steps"], config["warmup"], config["batch"], config["seq_len"]) == (2, 1, 2, 32)
    assert config["memory_track"] == memory_track
    compiled = report["compile_time"]  # measured by the trainer's compile callbacks
    if config["compile"]:
        assert compiled["compiles"] > 0 and compiled["seconds"] > 0
    elif not cuda:  # (on CUDA BF16 moments compile their optimizer step whatever [compile] says)
        assert compiled == {"compiles": 0, "seconds": 0.0}
    if cuda:  # the allocator's peaks and the kernel split are CUDA's; on CPU they are not measured: null
        check_gpu_time_split(report["gpu_time_split"])
        assert 0 < report["allocator"]["peak_allocated_bytes"] <= report["allocator"]["peak_reserved_bytes"]
    else:
        assert report["gpu_time_split"] is None and report["allocator"] is None

    steps = report["step_time_s"]
    times = steps["all"]
    assert len(times) == 2 and min(times) > 0
    assert (steps["median"], steps["min"], steps["max"]) == (statistics.median(times), min(times), max(times))
    ranks = report["rank_step_time_s"]
    assert len(ranks) == world_size and ranks[0] == steps["median"]  # rank 0's own median comes first
    tokens_per_step = config["batch"] * config["seq_len"]  # global batch -1: no accumulation
    assert report["tokens_per_s"] == pytest.approx(tokens_per_step / steps["median"])
    assert report["aggregate_tokens_per_s"] == pytest.approx(sum(tokens_per_step / t for t in ranks))
    assert report["model_tflops"] == pytest.approx(report["tokens_per_s"] * config["flops_per_token"] / 1e12)
    free = report["free_running"]
    assert free["steps"] == 2 and free["seconds"] > 0
    assert free["tokens_per_s"] == pytest.approx(2 * tokens_per_step / free["seconds"])
    assert free["mfu"] == pytest.approx(free["tokens_per_s"] * config["flops_per_token"] / 1e12 / report["peak_tflops"])
    peaks = report["gemm_peak_tflops"]
    fp8 = config["fp8_recipe"] != "none"
    # the FP8 peak is measured with a recipe only, and then counts the FP8 FLOPs' time in mfu_recipe
    assert sorted(peaks) == sorted(["bfloat16", "float32"] + (["float8_e4m3fn"] if fp8 else []))
    assert min(peaks.values()) > 0
    assert report["peak_tflops"] == peaks[config["dtype"]]
    assert report["mfu"] == pytest.approx(report["model_tflops"] / report["peak_tflops"])
    flops, fp8_flops = config["flops_per_token"], config["fp8_flops_per_token"]
    assert config["fp8_flops_share"] == pytest.approx(fp8_flops / flops)
    if fp8:
        assert 0 < fp8_flops < flops
        assert report["mfu_recipe"] == pytest.approx(report["tokens_per_s"] * (
            fp8_flops / peaks["float8_e4m3fn"] + (flops - fp8_flops) / report["peak_tflops"]) / 1e12)
    else:
        assert fp8_flops == 0 and report["mfu_recipe"] is None

    split, share = report["time_split_s"], report["time_split_share"]
    assert sorted(split) == sorted(PHASES) and min(split.values()) >= 0
    assert split["forward"] > 0 and split["backward"] > 0
    assert share == pytest.approx({k: v / sum(split.values()) for k, v in split.items()})
    assert report["top_ops"] and all(op["self_cpu_ms"] >= 0 and op["count"] > 0 for op in report["top_ops"])
    budget = report["time_budget"]
    for kind in ("matmul", "attention"):
        b = budget[kind]
        assert b["at_peak_s"] > 0, kind
        assert b["efficiency"] == (pytest.approx(b["at_peak_s"] / b["measured_s"]) if b["measured_s"] else None)
    assert budget["matmul"]["measured_s"] > 0
    # on CUDA the smoke model's tiny fp32 attention may run SDPA's math path, whose kernels are GEMMs and softmax
    assert budget["attention"]["measured_s"] > 0 or cuda
    assert budget["step_at_peak_s"] == pytest.approx(budget["matmul"]["at_peak_s"] + budget["attention"]["at_peak_s"])
    assert budget["rest_s"] == pytest.approx(
        budget["profiled_step_s"] - budget["matmul"]["measured_s"] - budget["attention"]["measured_s"])
    assert 0 <= budget["rest_s"] < budget["profiled_step_s"]


def check_gpu_time_split(split: dict) -> None:
    """gpu_time_split (CUDA runs): busy + idle is the step, the shares are the times over the step."""
    phases = split["phase_kernel_s"]
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    assert sorted(split["kernel_s"]) == sorted(KERNEL_CATEGORIES)
    assert 0 < split["busy_s"] <= split["step_s"] and split["idle_s"] == pytest.approx(
        split["step_s"] - split["busy_s"])
    assert split["share_of_step"] == pytest.approx(
        {**{k: v / split["step_s"] for k, v in split["kernel_s"].items()}, "idle": split["idle_s"] / split["step_s"]})
    assert split["kernel_s"]["gemm"] + split["kernel_s"]["grouped_gemm"] > 0 and split["kernels"] > 0
    # every idle second charged to something: what the host did, the device, the step's end, or a kernel whose
    # launch the profile lacks
    assert sum(split["idle_by_host"]["by_phase_s"].values()) == pytest.approx(split["idle_s"])


# Kernel names as torch's profiler reports them on CUDA (demangled; long template arguments shortened with ...).
RECORDED_KERNELS = {
    "gemm": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
        "kernel__5x_cublas",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>("
        "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
        "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, ...)",
        "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, ...>(...)",
        "triton_tem_fused_mm_0",
    ],
    "grouped_gemm": [
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
        "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::"
        "CollectiveMma<cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecializedCooperative<...> > > > >(...)",
        "triton_tem_fused__grouped_mm_1",
    ],
    "attention": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, 128, 64, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<192, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, "
        "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_128x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
        "triton_tem_fused_flex_attention_0",
    ],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, double, double, double, double, double, bool, double*, float*>(...)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::NormType)1, "
        "float, float>, float*, int>(...)",
        "void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, float>(float const*, "
        "at::native::TensorListAddresses, int)",
    ],
    "casts_copies": [
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, "
        "2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
        "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(...)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, ...)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_aligned16_contig<...>(...)",
    ],
    "elementwise": [
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<...> >(int, ...)",
        "void at::native::index_elementwise_kernel<128, 4, ...>(long, ...)",
        "triton_poi_fused__to_copy_add_mul_0",
    ],
    "communication": ["ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                      "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                      "void deep_ep::intranode::dispatch<8, 768, 8192>(...)"],
    "memcpy": ["Memcpy HtoD (Pageable -> Device)", "Memcpy DtoH (Device -> Pageable)", "Memset (Device)"],
    "other": [
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
        "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<...> > >(...)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)",
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, "
        "true>(...)",
        "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>(...)",
        "triton_red_fused__to_copy_mean_pow_1",
        "triton_per_fused_sum_2",
    ],
}


@pytest.mark.parametrize("category", sorted(RECORDED_KERNELS))
def test_kernel_classifier_on_recorded_names(category):
    assert set(RECORDED_KERNELS) == set(KERNEL_CATEGORIES)
    for name in RECORDED_KERNELS[category]:
        assert kernel_category(name) == category, name


def test_busy_time_is_the_union_of_kernel_intervals():
    # two overlapping kernels (two streams), one inside another, one crossing the window's end, one outside
    intervals = [(1.0, 3.0), (2.0, 4.0), (2.5, 2.6), (9.0, 12.0), (20.0, 21.0)]
    assert busy_seconds(intervals, (0.0, 10.0)) == pytest.approx(3.0 + 1.0)
    assert busy_seconds([], (0.0, 10.0)) == 0.0


def test_gpu_time_split_by_category_with_idle_gaps():
    gemm, adam = RECORDED_KERNELS["gemm"][1], RECORDED_KERNELS["optimizer"][0]
    nccl = RECORDED_KERNELS["communication"][0]
    # 10 s window: gemm 1-3, nccl 2-5 on another stream (overlaps 1 s), adam 6-7, gemm again 7-8: busy 1-5, 6-8
    kernels = [(gemm, 1.0, 3.0), (nccl, 2.0, 5.0), (adam, 6.0, 7.0), (gemm, 7.0, 8.0), (gemm, 11.0, 12.0)]
    split = gpu_time_split(kernels, (0.0, 10.0))
    check = {**dict.fromkeys(KERNEL_CATEGORIES, 0.0), "gemm": 3.0, "communication": 3.0, "optimizer": 1.0}
    assert split["kernel_s"] == pytest.approx(check)
    assert (split["step_s"], split["busy_s"], split["idle_s"], split["kernels"]) == pytest.approx((10, 6, 4, 4))
    assert split["share_of_step"]["idle"] == pytest.approx(0.4) and split["share_of_step"]["gemm"] == 0.3
    assert split["top_kernels"][0] == {"name": gemm, "category": "gemm", "ms": 3000.0, "count": 2}


def test_step_window_and_device_kernels_from_a_profile():
    """The profiler's events as the benchmark reads them (attribute names of this torch): the labelled step's
    window holds its ops; on CPU there are no device kernels, so the GPU would be idle throughout."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.throughput import STEP_LABEL, device_kernels, idle_by_host, step_window

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(x, x)
        with record_function(STEP_LABEL):
            torch.mm(x, x).sum()
    events = prof.events()
    lo, hi = step_window(events)
    inside = [e.name for e in events if lo <= e.time_range.start / 1e6 and e.time_range.end / 1e6 <= hi]
    assert {"aten::mm", "aten::sum"} <= set(inside) and inside.count("aten::mm") == 1
    assert device_kernels(events) == []
    split = gpu_time_split(device_kernels(events), (lo, hi))
    assert split["idle_s"] == split["step_s"] == pytest.approx(hi - lo) and split["busy_s"] == 0
    idle = idle_by_host(events, (lo, hi))  # the real events' fields: with no kernel, all of it is the step's end
    assert idle["by_phase_s"]["step_end"] == pytest.approx(hi - lo) and idle["gaps"]["count"] == 0


def _event(name, start_us, end_us, device="cpu", thread=1, parent=None, kernels=(), annotation=False, id=0):
    """A stand-in for the profiler's FunctionEvent with the fields the benchmark reads."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval, Kernel

    return SimpleNamespace(name=name, time_range=Interval(start_us, end_us), thread=thread, cpu_parent=parent,
                           device_type=DeviceType.CUDA if device == "cuda" else DeviceType.CPU,
                           is_user_annotation=annotation, self_cpu_time_total=0.0,
                           kernels=[Kernel(k, 0, d) for k, d in kernels], id=id)


def test_cuda_profile_parsing_on_stand_in_events():
    """How the benchmark reads a CUDA profile: kernels, not the GPU copies of record_function ranges; the host's
    step window; kernel time by the phase of the launching op, backward on the autograd engine's own thread."""
    from benchmarks.throughput import STEP_LABEL, device_kernels, phase_kernel_seconds, step_window

    gemm, adam = RECORDED_KERNELS["gemm"][1], RECORDED_KERNELS["optimizer"][0]
    step = _event(STEP_LABEL, 0, 10_000, annotation=True, kernels=[(STEP_LABEL, 9_000)])
    fwd = _event("phase/forward", 100, 2_000, parent=step, annotation=True, kernels=[("phase/forward", 1_500)])
    mm = _event("aten::mm", 200, 300, parent=fwd, kernels=[(gemm, 1_000)])
    bwd_node = _event("autograd::engine::evaluate_function: MmBackward0", 2_500, 2_600, thread=2)
    mm_bwd = _event("aten::mm", 2_510, 2_590, thread=2, parent=bwd_node, kernels=[(gemm, 2_000)])
    opt = _event("Optimizer.step#AdamW.step", 5_000, 5_100, parent=step, annotation=True)
    fused = _event("aten::_fused_adamw_", 5_010, 5_090, parent=opt, kernels=[(adam, 700)])
    gloo = _event("aten::mm", 5_000, 5_050, thread=3, kernels=[(gemm, 50)])  # another thread: not the step's
    on_gpu = [_event(STEP_LABEL, 50, 9_500, device="cuda", annotation=True),
              _event("phase/forward", 300, 1_800, device="cuda", annotation=True),
              _event(gemm, 300, 1_300, device="cuda"), _event(gemm, 2_700, 4_700, device="cuda"),
              _event(adam, 5_200, 5_900, device="cuda")]
    events = [step, fwd, mm, bwd_node, mm_bwd, opt, fused, gloo] + on_gpu
    assert step_window(events) == (0.0, 0.01)
    assert device_kernels(events) == [(gemm, 3e-4, 1.3e-3), (gemm, 2.7e-3, 4.7e-3), (adam, 5.2e-3, 5.9e-3)]
    phases = phase_kernel_seconds(events)
    assert phases == pytest.approx({"data": 0, "forward": 1e-3, "backward": 2e-3, "optimizer": 7e-4,
                                    "communication": 0, "other": 0})
    split = gpu_time_split(device_kernels(events), step_window(events))
    assert split["busy_s"] == pytest.approx(3.7e-3) and split["idle_s"] == pytest.approx(6.3e-3)


def test_idle_time_charged_to_what_the_host_was_doing():
    """idle_by_host on stand-in events: each gap goes to the kernel that ends it; to the phase and op of its launch
    (the runtime call with the kernel's id) when the launch came after the GPU fell idle, to "device" when it came
    before (the GPU waited on something else), "unlinked" without a launch; the tail is "step_end". Kernels on two
    streams that overlap leave no gap, and an op whose id happens to equal a kernel's is not its launch."""
    from benchmarks.throughput import STEP_LABEL, device_kernels, idle_by_host, step_window

    gemm, adam = RECORDED_KERNELS["gemm"][1], RECORDED_KERNELS["optimizer"][0]
    step = _event(STEP_LABEL, 0, 10_000, annotation=True)
    data = _event("phase/data", 0, 400, parent=step, annotation=True)
    copy = _event("aten::copy_", 100, 350, parent=data)
    fwd = _event("phase/forward", 400, 2_000, parent=step, annotation=True)
    mm, mm2 = _event("aten::mm", 450, 500, parent=fwd), _event("aten::mm", 600, 650, parent=fwd)
    node = _event("autograd::engine::evaluate_function: MmBackward0", 2_500, 2_600, thread=2)
    mm_bwd = _event("aten::mm", 2_510, 2_590, thread=2, parent=node)
    opt = _event("Optimizer.step#BF16MomentsAdamW.step", 5_000, 5_100, parent=step, annotation=True)
    triton = _event("triton_poi_fused_0", 5_010, 5_090, parent=opt, id=16)  # an op's id: not a launch
    host = [step, data, copy, fwd, mm, mm2, node, mm_bwd, opt, triton,
            _event("cudaMemcpyAsync", 300, 320, parent=copy, id=11),
            _event("cudaLaunchKernel", 460, 465, parent=mm, id=12),
            _event("cudaLaunchKernel", 610, 615, parent=mm2, id=13),
            _event("cudaLaunchKernel", 2_520, 2_530, thread=2, parent=mm_bwd, id=14),
            _event("cudaLaunchKernel", 2_570, 2_575, thread=2, parent=mm_bwd, id=15),
            _event("cuLaunchKernelEx", 5_050, 5_060, parent=triton, id=16)]
    device = [_event("Memcpy HtoD (Pinned -> Device)", 330, 380, device="cuda", id=11),
              _event(gemm, 470, 1_300, device="cuda", id=12),
              _event(gemm, 700, 1_200, device="cuda", id=13),  # another stream, inside the one before
              _event(gemm, 2_700, 4_700, device="cuda", id=14),
              _event(gemm, 4_790, 4_890, device="cuda", id=15),  # launched long before: waited on the device
              _event(adam, 5_200, 5_900, device="cuda", id=16),
              _event(adam, 5_990, 6_090, device="cuda", id=99),  # no launch in the profile
              _event(STEP_LABEL, 50, 9_500, device="cuda", annotation=True)]
    window = step_window(host + device)
    idle = idle_by_host(host + device, window)
    assert idle["by_phase_s"] == pytest.approx({
        "data": 330e-6, "forward": 90e-6, "backward": 1_400e-6, "optimizer": 310e-6, "communication": 0,
        "other": 0, "device": 90e-6, "step_end": 3_910e-6, "unlinked": 90e-6})
    split = gpu_time_split(device_kernels(host + device), window)
    assert sum(idle["by_phase_s"].values()) == pytest.approx(split["idle_s"])
    assert idle["gaps"] == {"count": 6, "over_100us": 3, "over_1ms": 1}
    assert idle["by_op"][:3] == [{"phase": "backward", "op": "aten::mm", "ms": 1.4, "gaps": 1},
                                 {"phase": "data", "op": "aten::copy_", "ms": 0.33, "gaps": 1},
                                 {"phase": "optimizer", "op": "triton_poi_fused_0", "ms": 0.31, "gaps": 1}]
    assert {(e["phase"], e["op"]) for e in idle["by_op"][3:]} == {("forward", "aten::mm"), ("device", "aten::mm"),
                                                                  ("unlinked", adam[:80])}  # names cut at 80
    assert idle["largest"][:3] == [
        {"ms": 1.4, "phase": "backward", "path": "autograd::engine::evaluate_function: MmBackward0 > aten::mm"},
        {"ms": 0.33, "phase": "data", "path": "phase/data > aten::copy_"},
        {"ms": 0.31, "phase": "optimizer",
         "path": "Optimizer.step#BF16MomentsAdamW.step > triton_poi_fused_0"}]


@pytest.mark.cuda
def test_cuda_idle_time_charged_to_the_host_phase_that_kept_the_gpu_waiting():
    """On a GPU, the profiler's own events: a 20 ms host stall before a launch in the optimizer phase is charged
    to that phase and op, which checks that the runtime calls carry their kernels' ids on this torch."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.throughput import STEP_LABEL, idle_by_host, step_window

    x = torch.randn(2048, 2048, device="cuda")
    torch.mm(x, x)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(STEP_LABEL):
            torch.cuda.synchronize()
            with record_function("phase/forward"):
                y = torch.mm(x, x)
            with record_function("phase/optimizer"):
                time.sleep(0.02)
                y.add_(1)
            torch.cuda.synchronize()
    events = prof.events()
    idle = idle_by_host(events, step_window(events))
    assert idle["by_phase_s"]["optimizer"] > 0.015, idle
    assert idle["by_op"][0]["phase"] == "optimizer" and idle["by_op"][0]["op"].startswith("aten::add"), idle
    assert idle["by_phase_s"]["unlinked"] == 0, idle


@pytest.mark.cuda
def test_cuda_idle_before_a_compiled_kernel_is_charged_to_its_launch():
    """Triton's kernels are launched through the driver API (cuLaunchKernel / cuLaunchKernelEx): the profile must
    link them to their launch too, or the idle time before compiled code would count as "unlinked"."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.throughput import STEP_LABEL, idle_by_host, step_window

    double = torch.compile(lambda t: t * 2 + 1, fullgraph=True)
    x = torch.randn(1 << 20, device="cuda")
    double(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(STEP_LABEL):
            torch.cuda.synchronize()
            with record_function("phase/data"):
                time.sleep(0.02)
                double(x)
            torch.cuda.synchronize()
    events = prof.events()
    idle = idle_by_host(events, step_window(events))
    assert idle["by_phase_s"]["data"] > 0.015 and idle["by_phase_s"]["unlinked"] == 0, idle


@pytest.mark.slow
def test_smoke_report_schema():
    report = _run_json("benchmarks/throughput.py", timeout=120)
    check_throughput_report(report, world_size=1, ep=1, memory_track="exact")
    assert report["aggregate_tokens_per_s"] == report["tokens_per_s"]  # one process: the job is this rank
    # the smoke run tracks memory exactly, so the trainer's peak is reported: at least the fp32 parameters, their
    # gradients and AdamW's two states, all alive in the optimizer step
    assert isinstance(report["peak_memory_bytes"], int)
    assert report["peak_memory_bytes"] >= 4 * 4 * report["config"]["params"]
    assert report["time_split_s"]["communication"] == 0.0  # one process: no collectives


@pytest.mark.slow
def test_fp8_smoke_report_counts_the_selected_flops_at_the_fp8_peak(tmp_path):
    """--smoke with the blockwise recipe, on the smoke model widened to 128 (two heads of 64 + 64) so that every
    selected dim is a multiple of the recipe's tile: the FP8 FLOPs are the table's entries that the default [fp8]
    filters select (all but attention.wkv_a, 128 + 64 wide), and mfu_recipe is recomputed from the report."""
    args = FLAVORS["debugmodel"].replace(**{**SMOKE_ARGS, "dim": 128, "inter_dim": 128, "moe_inter_dim": 128,
                                            "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
                                            "v_head_dim": 64})
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config_from_args(args)))
    report = _run_json("benchmarks/throughput.py", 300, "--fp8.recipe", "blockwise",
                       "--model.hf_config_path", str(config))
    check_throughput_report(report, world_size=1, ep=1, memory_track="exact")
    table = block_flops_per_token(args)
    assert report["config"]["fp8_recipe"] == "blockwise"
    assert report["config"]["fp8_flops_per_token"] == sum(table.values()) - table["attention.wkv_a"]


def test_attention_kernels_smoke_runs_every_variant_or_says_why(capsys):
    from benchmarks import attention_kernels

    report = attention_kernels.main(["--smoke"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
    c, results = report["config"], report["results"]
    # the trainer's count of causal attention FLOPs, for one layer over batch x seq tokens
    shape = SimpleNamespace(n_heads=c["heads"], qk_head_dim=c["qk_head_dim"], v_head_dim=c["v_head_dim"],
                            n_layers=1, num_mtp_layers=0)
    assert c["flops"] == attention_flops_per_token(shape, c["seq"]) * c["batch"] * c["seq"]
    assert set(results) == {"model"} | {f"{layout}/{b}" for layout in ("unequal", "padded")
                                         for b in attention_kernels.BACKENDS}
    for name, r in results.items():
        if "error" in r:
            assert set(r) == {"error"} and r["error"], name
            continue
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0, name
        assert r["tflops"] == pytest.approx(c["flops"] / (r["forward_backward_ms"] / 1e3) / 1e12), name
        assert (r["peak_bytes"] is None) is c["device"].startswith("cpu"), name
        # bf16 against the fp64 reference: output and all three input gradients
        assert r["max_abs_error"] < 3e-2, (name, r)
    # the model's own path and the math kernel run on every device; flash never takes v as it is
    assert "error" not in results["model"] and "error" not in results["unequal/math"]
    assert "error" in results["unequal/flash"]


def test_bad_flag_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "benchmarks/throughput.py", "--smoke", "--compile.enable", "true"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "config error: memory.track: exact tracking makes compiled code run eagerly (it would silently measure an "
        "uncompiled run); allowed: auto or off with compile.enable = true"]


@pytest.mark.slow
def test_scaling_smoke_report_against_its_runs():
    """One torchrun launch (2 ranks, EP 2) after 2 concurrent single-process runs: each run's report is checked
    as above, and the summary is recomputed from them."""
    report = _run_json("benchmarks/scaling.py", timeout=300)
    assert report["config"]["nproc"] == 2 and report["config"]["memory_track"] == "off"
    independent, ep = report["independent"], report["expert_parallel"]
    runs = independent["reports"]
    assert len(runs) == 2
    for run in runs:
        check_throughput_report(run, world_size=1, ep=1, memory_track="off")
        assert run["time_split_s"]["communication"] == 0.0
    assert independent["tokens_per_s"] == [r["tokens_per_s"] for r in runs]
    assert independent["step_time_s"] == [r["step_time_s"]["median"] for r in runs]
    assert independent["aggregate_tokens_per_s"] == pytest.approx(sum(independent["tokens_per_s"]))
    check_throughput_report(ep["report"], world_size=2, ep=2, memory_track="off")
    assert ep["report"]["peak_memory_bytes"] is None  # memory.track off
    assert ep["step_time_s"] == ep["report"]["rank_step_time_s"]
    assert (ep["tokens_per_s"], ep["aggregate_tokens_per_s"]) == (ep["report"]["tokens_per_s"],
                                                                   ep["report"]["aggregate_tokens_per_s"])
    # the EP all-to-all and FSDP collectives are seen by the profiler
    split = ep["report"]["time_split_s"]
    assert ep["communication_s"] == split["communication"] > 0
    assert ep["communication_share"] == pytest.approx(split["communication"] / sum(split.values()))
    assert report["ratio"] == pytest.approx(ep["aggregate_tokens_per_s"] / independent["aggregate_tokens_per_s"])


@pytest.mark.slow
def test_gpu_session_script_skips_what_its_deadline_leaves_no_room_for(tmp_path):
    """benchmarks/gpu_session.sh on CPU: the machine file, a step run (the kernel benchmark, which needs CUDA: exit
    code 1) or skipped when the deadline leaves it less than two thirds of its limit, the summary and the table,
    and the tarball, made inside the output folder it packs."""
    if (REPO / ".venv").exists() and not (REPO / ".venv" / "pyvenv.cfg").exists():
        pytest.skip("the script would replace this .venv (not a virtual environment) by its wrapper")

    def session(deadline_s: int, out: Path) -> str:
        env = {**os.environ, "PARTS": "kernels", "DEADLINE_S": str(deadline_s), "OUT": str(out),
               "TARBALL": str(out / "session.tgz")}
        r = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-4000:]
        assert "torch" in (out / "machine.txt").read_text()
        assert "Targets (free-running, compiled):" in (out / "table.md").read_text()
        with tarfile.open(out / "session.tgz") as tar:
            names = {os.path.normpath(n) for n in tar.getnames()}
        assert {"machine.txt", "summary.txt", "table.md"} <= names and "session.tgz" not in names, names
        return (out / "summary.txt").read_text()

    ran = session(300, tmp_path / "ran")
    assert re.fullmatch(r"fp8_kernels rc=1 \d+s\n", ran), ran
    assert "needs a CUDA GPU" in (tmp_path / "ran" / "fp8_kernels.log").read_text()
    skipped = session(40, tmp_path / "skipped")  # the kernel step's limit is 75 s: it needs 50 s
    assert re.fullmatch(r"fp8_kernels skipped: deadline \(-?\d+ s left of the 50 s it needs\)\n", skipped), skipped


def test_gpu_summary_checks_the_targets_from_the_reports(tmp_path, monkeypatch):
    """benchmarks/gpu_summary.py: the table's rows and the targets from synthetic reports (ratios of free-running
    tokens/s, MFU), a target whose reports are missing is "not run" with what its log says was compiled, the junit
    counts."""
    from benchmarks.gpu_summary import summary

    def report(name, tokens_per_s, mfu):
        free = {"steps": 10, "seconds": 1.0, "tokens_per_s": tokens_per_s, "mfu": mfu}
        split = {"kernel_s": {"optimizer": 0.02}, "idle_s": 0.004, "idle_by_host": {"by_phase_s": {
            "forward": 0.0005, "optimizer": 0.002, "step_end": 0.0012, "data": 0.0003, "backward": 0.0}, "by_op": [
            {"phase": "optimizer", "op": "triton_poi_fused_0", "ms": 1.5, "gaps": 55},
            {"phase": "forward", "op": "aten::mm", "ms": 0.5, "gaps": 2}]}}
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "tokens_per_s": tokens_per_s * 0.9, "mfu": mfu * 0.9, "free_running": free,
            "peak_memory_bytes": 3 * 2**30, "gpu_time_split": split,
            "compile_time": {"compiles": 4, "seconds": 31.25}}))

    report("b671_bf16", 1000.0, 0.4)
    report("b671_fp8_blockwise", 1200.0, 0.48)
    report("b671_fp8_rowwise", 1100.0, 0.44)
    report("b16_b4", 5000.0, 0.56)
    (tmp_path / "machine.json").write_text("[1, 2]")  # not a report
    # stopped while compiling: the trainer's compile lines (trainer/compile_times.py) are all its log has
    clock = [0.0]
    monkeypatch.setattr("trainer.compile_times.time", SimpleNamespace(perf_counter=lambda: clock[0]))
    with _log_of(tmp_path / "b16_b2.log"), CompileTimes():
        for trigger, seconds in ((CallbackTrigger.DYNAMO, 40.0), (CallbackTrigger.LAZY_BACKWARD, 30.0)):
            _fake_compile(clock, trigger, seconds)
    (tmp_path / "tests_cuda.xml").write_text('<testsuites><testsuite tests="12" failures="1" errors="0" '
                                             'skipped="2"/></testsuites>')
    text = summary(str(tmp_path))
    assert "| b671_fp8_blockwise | 1,080 | 1,200 | 43.2% | 48.0% | 3.00 | 20.0 | 4.0 | optimizer 2.0, step_end " \
           "1.2, forward 0.5 | 31.2 |" in text
    assert "- b16_b4: optimizer / triton_poi_fused_0 1.5 ms (55 gaps); forward / aten::mm 0.5 ms (2 gaps)" in text
    assert "- 671B shapes: FP8 blockwise / bf16 tokens/s >= 1.15: 1.20x PASS" in text
    assert "- 671B shapes: FP8 rowwise / bf16 tokens/s >= 1.15: 1.10x FAIL" in text
    assert "- 16B shapes, compiled B4: MFU >= 55%: 56.0% PASS" in text
    assert "- 16B shapes, compiled B2: MFU >= 50%: not run (b16_b2 missing; b16_b2: its log: 2 compiles done in " \
           "70.0 s, the slowest graph 0/0 (40.0 s))" in text
    assert "- tests_cuda.xml: 12 tests, 1 failures, 0 errors, 2 skipped" in text
    assert "machine" not in text
