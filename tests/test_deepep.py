"""The DeepEP backend on CPU, through the stand-in Buffer (parallelisms/moe_comm/deepep_cpu.py).

Multi-rank checks run in one launch of ranks per world size: this file is also the worker (`python
tests/test_deepep.py jobs.json out.json` on ranks, `tests/dist_utils.launch_json`), which runs
  * the stand-in's Buffer contract (tuples, dtypes, masks, local ids, cached mode, combine, rejected inputs);
  * parity: a MoE layer with the DeepEP dispatcher vs the all-to-all dispatcher, fp32, outputs and all grads
    (and with the real kernels' bf16 wire);
  * the handle lifecycle on every execution path (no AC, full AC, full AC with early stop, SAC saving the DeepEP
    ops, SAC recomputing them, no_grad, inference_mode, two microbatches in flight, an exception between dispatch
    and combine): live handles 0 at every step end and the exact step-end memory (MemoryMonitor, exact mode; a
    hook-free storage counter for the exception path, see `_LiveStorageBytes`) constant after the first step;
  * the same with the registry's release patched away, to show the checks catch a leak;
  * host syncs of a 2-layer EP stack per backend and AC mode: one per MoE layer in forward, none in backward
    (except where a recompute reruns a DeepEP dispatch), and two per layer under torch's plain full checkpoint;
  * FP8 dispatch (blockwise experts) on both backends: e4m3 vs fp32 rows on the wire give the same outputs and
    gradients, on a layer and through the trainer;
  * training parity: `expert_parallel_comm_backend = "deepep"` vs `"alltoall"` through the trainer, with
    validation (the no_grad path) every step and exact memory tracking, and the backend's metrics in the log;
  * a handle leak on one rank only (2 ranks: rank 1's registry never releases): rank 0's tensorboard shows the
    live handles across ranks growing, rank 1 holding the most, and rank 1's handle-leak alarm;
  * the log says once per process that the CPU stand-in runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import os
import re
import sys
import time
import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from quantization.fp8.quantize import dequantize, quantize  # noqa: E402
from parallelisms.moe_comm import deepep, deepep_cpu  # noqa: E402
from parallelisms.moe_comm.deepep import (HANDLES, DeepEPUnavailableError, HandleRegistry,  # noqa: E402
                                          deepep_available)

STEPS = 4
PATHS = ("none", "full", "full_early_stop", "sac_saved", "sac_recomputed", "no_grad", "inference_mode",
         "microbatches", "exception")
TRAIN_BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32",
              "--training.global_batch_size", "4", "--training.local_batch_size", "1", "--training.steps", "4",
              "--validation.enable", "true", "--validation.freq", "1", "--validation.steps", "1",
              "--memory.leak_window", "0", "--metrics.enable_tensorboard", "false",
              "--training.deterministic", "true"]
TRAIN_KEYS = ("loss", "grad_norm", "validation/loss", "memory/allocated_GiB", "moe/live_handles",
              "memory/deepep_buffer_GiB")


# ----------------------------------------------------------------------------------------------- single process

def test_deepep_kernels_unavailable_without_cuda():
    ok, why = deepep_available()
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: availability depends on the deep_ep install")
    assert not ok and "no CUDA device" in why and "stand-in" in why


@pytest.mark.parametrize("backend, standin", [("gloo", True), ("fake", True), ("nccl", False),
                                              ("cpu:gloo,cuda:nccl", False), ("ucc", None)])
def test_only_gloo_groups_get_the_standin(monkeypatch, backend, standin):
    monkeypatch.setattr(deepep.dist, "get_backend", lambda group: backend)
    if standin is None:
        with pytest.raises(DeepEPUnavailableError, match="NCCL process group .* got a 'ucc' group"):
            deepep._uses_standin(object())
    else:
        assert deepep._uses_standin(object()) is standin


def test_a_cpu_run_passes_the_config_check():
    from trainer.job_config import load_config, validate_job

    if torch.cuda.is_available():
        pytest.skip("CUDA machine: a deepep run there needs deep_ep")
    cfg = load_config(["--parallelism.expert_parallel_degree", "2",
                       "--parallelism.expert_parallel_comm_backend", "deepep"])
    assert validate_job(cfg, 2).ep == 2


def test_size_hints_follow_deepep_rules():
    for n in (2, 4, 8):
        dispatch, combine = deepep_cpu.Buffer.get_dispatch_config(n), deepep_cpu.Buffer.get_combine_config(n)
        for cfg in (dispatch, combine):
            small, large = cfg.get_nvl_buffer_size_hint(512, n), cfg.get_nvl_buffer_size_hint(1024, n)
            assert 0 < small < large and small % 128 == 0
            assert cfg.get_rdma_buffer_size_hint(512, n) == 0  # intranode
    with pytest.raises(NotImplementedError):
        deepep_cpu.Buffer.get_dispatch_config(3)


def test_a_new_group_with_a_destroyed_groups_name_gets_its_own_buffer(monkeypatch):
    """torch names groups from 0 again after the default group is destroyed and created anew: the buffer of the
    destroyed group must not serve the new group of the same name, nor be looked up for it."""
    class Group:
        group_name = "1"

        def size(self) -> int:
            return 2

    class Buffer(deepep_cpu.Buffer):
        def __init__(self, group, num_nvl_bytes: int, num_rdma_bytes: int) -> None:
            self.group, self.num_nvl_bytes, self.num_rdma_bytes = group, num_nvl_bytes, num_rdma_bytes

    monkeypatch.setattr(deepep.dist, "get_backend", lambda group: "gloo")
    monkeypatch.setattr(deepep.deepep_cpu, "Buffer", Buffer)
    manager = deepep.BufferManager()
    old, new = Group(), Group()
    first = manager.get(old, 1024)
    assert manager.get(old, 1024) is first and manager.get(old, 512) is first  # big enough: kept
    second = manager.get(new, 1024)
    assert second is not first and second.group is new
    assert manager.lookup("1") is second and manager.get(new, 1024) is second


def test_custom_ops_resolve_in_the_sac_op_table():
    from parallelisms.moe_comm.registry import op_table

    assert op_table().resolve("deepep_dispatch") == [torch.ops.deepep.dispatch.default]
    assert op_table().resolve("deepep_combine") == [torch.ops.deepep.combine.default]


def test_registry_owns_handles_until_taken_or_dropped():
    registry = HandleRegistry()

    class Owner:
        pass

    a = registry.add((torch.zeros(3),), "g")
    b = registry.add((torch.zeros(3),), "g")
    owner = Owner()
    registry.release_when_dropped(owner, b)
    assert registry.pending() == 2 and registry.live_handles() == 2
    taken = registry.take(a)
    assert registry.pending() == 1 and registry.live_handles() == 2  # taken: alive, owned by the taker
    del taken
    assert registry.live_handles() == 1
    del owner  # the finalizer releases what no combine took
    assert registry.pending() == 0 and registry.live_handles() == 0
    registry.release(b)  # idempotent


# ----------------------------------------------------------------------------------------------- multi process

def _launch(nproc: int, jobs: dict, tmp_path) -> dict:
    from dist_utils import launch_json
    from small_models import SMALL, hf_config_file

    base = TRAIN_BASE + ["--model.hf_config_path", hf_config_file(SMALL, tmp_path)]
    jobs = dict(jobs, train={name: base + ["--job.dump_folder", str(tmp_path / name)] + args
                             for name, args in jobs.get("train", {}).items()})
    if "handle_leak" in jobs:
        leak = jobs["handle_leak"]
        jobs["handle_leak"] = dict(leak, args=[*base, "--job.dump_folder", str(tmp_path / "handle_leak"),
                                               *leak["args"]])
    return launch_json(nproc, os.path.abspath(__file__), jobs, tmp_path, timeout=600)


def _check_parity(parity: dict) -> None:
    # fp32: the two backends sum the top-k contributions in another order (per rank first), nothing else differs
    for name, diff in parity["fp32"].items():
        assert diff <= 1e-6, (name, diff)
    # bf16 on the wire (what the real kernels carry) vs fp32 all-to-all: bf16 rounding only
    for name, diff in parity["bf16_wire"].items():
        assert diff <= 2e-2, (name, diff)
    # FP8 on the wire (blockwise FP8 experts): the experts see the same values, so nothing changes at all, also
    # where they compute in bf16 from fp32 rows (autocast) and where a rank receives no row (skewed)
    for name, fp8 in parity["fp8_dispatch"].items():
        assert fp8["max_abs_diff"] and all(d == 0.0 for d in fp8["max_abs_diff"].values()), (name, fp8)
        assert len(fp8["received"]) == 2 and fp8["received"][0] == fp8["received"][1], (name, fp8)
        if name.endswith("_skewed"):
            assert (fp8["received"][0] == 0) == fp8["last_rank"], (name, fp8)
    # DeepEP: forward dispatch in e4m3; the backward's cached dispatch (the gradient of combine) stays fp32
    fp8 = parity["fp8_dispatch"]["deepep_plain"]["wire"]
    assert fp8["fp8_wire"] == {"accepted": True, "sent": ["torch.float8_e4m3fn", "torch.float32"]}, fp8
    assert fp8["fp32_wire"] == {"accepted": False, "sent": ["torch.float32", "torch.float32"]}, fp8
    # all-to-all: the dispatched rows [n, 256] go as their e4m3 bytes and two fp32 scales each instead of fp32;
    # every other exchange (counts, routing weights, combine, and all of the backward) is the same
    fp8 = parity["fp8_dispatch"]["alltoall_plain"]["wire"]
    assert fp8["fp8_wire"]["accepted"] and not fp8["fp32_wire"]["accepted"], fp8
    plain, quantized = fp8["fp32_wire"]["sent"], fp8["fp8_wire"]["sent"]
    i = next(i for i, (dtype, shape) in enumerate(plain) if dtype == "torch.float32" and shape[1:] == [256])
    rows = plain[i][1][0]
    want = plain[:i] + [["torch.uint8", [rows, 256]], ["torch.float32", [rows, 2]]] + plain[i + 1:]
    assert quantized == want and len(plain) >= 7, (plain, quantized)


def _check_paths(paths: dict) -> None:
    for name, rec in paths.items():
        assert rec["live_handles"] == [0] * STEPS, (name, rec)
        assert rec["pending"] == [0] * STEPS, (name, rec)
        allocated = rec["allocated"]
        assert len(set(allocated[1:])) == 1, (name, allocated)  # exactly flat after the first step
    mb = paths["microbatches"]
    layers = 2
    assert mb["in_flight"] == [2 * layers] * STEPS and mb["after_first_backward"] == [layers] * STEPS


def _check_leak_is_caught(leak: dict) -> None:
    for name, rec in leak.items():
        handles, allocated = rec["live_handles"], rec["allocated"]
        assert handles == [2 * (i + 1) for i in range(STEPS)], (name, handles)  # 2 MoE layers leak per step
        growth = [b - a for a, b in zip(allocated, allocated[1:])]
        assert all(g > 0 for g in growth[1:]), (name, allocated)


def _check_host_syncs(syncs: dict) -> None:
    layers = 2
    # one sync per MoE layer in forward (the split sizes, DeepEP's received counts), none again in backward: the
    # AC policies save the split sizes, and a recomputed DeepEP dispatch reuses its forward's handle (cached mode)
    for backend in ("alltoall", "deepep"):
        for path in SYNC_PATHS:
            want = [layers, layers if path == "full_plain" else 0, 0.0]
            # without the policy and the memo (torch's checkpoint alone) the recompute syncs again: the check can fail
            assert syncs[f"{backend}/{path}"] == want, (backend, path, syncs)


def _check_training(train: dict, pairs: list[tuple[str, str]]) -> None:
    for with_deepep, alltoall in pairs:
        got, want = train[with_deepep], train[alltoall]
        for key, rel in (("loss", 1e-6), ("validation/loss", 1e-6), ("grad_norm", 1e-5)):
            a, b = [h[key] for h in got], [h[key] for h in want]
            assert a == pytest.approx(b, rel=rel), (with_deepep, key, a, b)
        assert [h["moe/live_handles"] for h in got] == [0.0] * len(got)
        assert got[0]["memory/deepep_buffer_GiB"] > 0
        allocated = [h["memory/allocated_GiB"] for h in got]
        assert len(set(allocated[1:])) == 1, (with_deepep, allocated)  # train + validation steps: flat


def _check_handle_leak(leak: dict) -> None:
    """Rank 1 leaks every dispatch's handle, rank 0 none: rank 0's run folder logs the live handles across ranks
    (their max growing by the same count each step, the rank holding it: 1) and rank 1's handle-leak alarm at step 4
    (warm-up 1 + window 3 + confirmation 1 - 1); rank 1 warns, naming itself."""
    own = leak["own"]
    assert own[0] == [0.0] * 5, own  # rank 0's own count, in its rank scalars
    growth = {b - a for a, b in zip(own[1], own[1][1:])}
    assert len(growth) == 1 and growth.pop() > 0 and own[1][0] > 0, own
    assert leak["max"] == own[1] and leak["min"] == [0.0] * 5, leak
    assert leak["worst"] == [[1, 1], [4, 1], [5, 1]], leak["worst"]  # (step, rank): logging steps (log_freq 5), alarm
    assert leak["alarm"] == [[4, 1.0]] and leak["alarm_rank"] == [[4, 1.0]], leak
    assert leak["warnings"][0] == [] and len(leak["warnings"][1]) == 1, leak["warnings"]
    assert re.match(r"rank 1 \(EP rank 1 of 2\): handle leak: MoE comm handles alive at step end grow \d+ "
                    r"handles/step \(Theil-Sen slope over steps 2-4", leak["warnings"][1][0]), leak["warnings"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layout, ep", [(2, "ep2", "2"), (4, "fsdp4_ep4", "4")], ids=["2ranks", "4ranks"])
def test_ranks(tmp_path, nproc, layout, ep):
    deepep_args = ["--parallelism.expert_parallel_degree", ep, "--parallelism.expert_parallel_comm_backend", "deepep"]
    # full AC: the recomputed dispatches reuse their forward's layout (cached mode), with FSDP inside the region
    train = {f"{layout}_alltoall": ["--parallelism.expert_parallel_degree", ep, "--memory.track", "off"],
             f"{layout}_deepep": deepep_args + ["--memory.track", "exact"],
             f"{layout}_deepep_full_ac": deepep_args + ["--memory.track", "exact",
                                                         "--activation_checkpoint.mode", "full"]}
    if nproc == 2:  # FP8 dispatch through the trainer: blockwise experts, rows on the wire in e4m3 or not
        fp8 = ["--memory.track", "off", "--fp8.recipe", "blockwise", "--training.steps", "2"]
        for backend, args in (("deepep", deepep_args), ("alltoall", ["--parallelism.expert_parallel_degree", ep])):
            train |= {f"fp8_wire_{backend}": args + fp8,
                      f"fp32_wire_{backend}": args + fp8 + ["--fp8.dispatch", "false"]}
    jobs = {"battery": True, "train": train}
    if nproc == 2:  # rank 1's handles are never released: tracking off, the handle detector still watches them
        jobs["handle_leak"] = {"rank": 1, "args": deepep_args + [
            "--memory.track", "off", "--validation.enable", "false", "--training.steps", "5",
            "--memory.leak_warmup_steps", "1", "--memory.leak_window", "3", "--metrics.enable_tensorboard", "true"]}
    out = _launch(nproc, jobs, tmp_path)
    assert out["standin_logs"] == [1] * nproc  # every rank says once that the stand-in runs
    for rank_result in out["battery"]:
        assert all(rank_result["api"].values()), rank_result["api"]
        _check_parity(rank_result["parity"])
        _check_paths(rank_result["paths"])
        _check_leak_is_caught(rank_result["leak"])
        _check_host_syncs(rank_result["syncs"])
    _check_training(out["train"], [(f"{layout}_deepep", f"{layout}_alltoall"),
                                   (f"{layout}_deepep_full_ac", f"{layout}_alltoall")])
    if nproc == 2:
        _check_handle_leak(out["handle_leak"])
        for backend in ("deepep", "alltoall"):
            fp8, fp32 = out["train"][f"fp8_wire_{backend}"], out["train"][f"fp32_wire_{backend}"]
            assert len(fp8) == 2 and fp8 == fp32, (backend, fp8, fp32)  # every logged scalar, bit for bit
        # one line per fp8_wire job (rank 0), every MoE layer sending e4m3; none for fp32_wire
        logs = out["fp8_dispatch_logs"]
        assert len(logs) == 2, logs
        for line, name in zip(logs, ("DeepEPDispatcher", "AllToAllDispatcher")):
            match = re.fullmatch(r"fp8 dispatch: (\d+) of (\d+) MoE layers with FP8 experts send e4m3 rows "
                                 rf"\({name}\)", line)
            assert match and match[1] == match[2] and int(match[1]) > 0, logs


@pytest.mark.slow
def test_fp8_dispatch_benchmark_smoke():
    """The benchmark's smoke run (all-to-all backend, EP 2, blockwise experts, bf16, no AC): with FP8 dispatch the
    forward's dispatched rows travel at 1 + 4/128 bytes per element instead of 2, every other exchange as before,
    with the same losses and gradient norms bit for bit (in bf16 the backward sums each token's top-k gradient rows
    as autograd's own indexing does); the bytes handed to the collectives are the planned ones plus the expert
    counts and routing weights, and the plan's peak is within 5% of the measured one."""
    from benchmarks.fp8_dispatch import run_benchmark
    from quantization.fp8.accounting import FP8_DISPATCH_BYTES

    [row] = run_benchmark(smoke=True)
    assert row["same_losses_and_grad_norms"] is True, row
    on, off = row["dispatch_on"], row["dispatch_off"]
    assert row["planned_forward_exchange_ratio"] == pytest.approx((FP8_DISPATCH_BYTES + 2) / 4, abs=1e-4)
    # forward (dispatch, combine) and backward (two gradients): 7 + 1/32 of 8 bytes per row element, where the rank
    # receives as many rows as it sends (routing moves the ratio a little: the measured rank may receive more)
    assert row["sent_ratio"] == pytest.approx((FP8_DISPATCH_BYTES + 6) / 8, abs=0.015), row
    for run in (on, off):
        # the plan's rows are balanced (each exchange the larger of sent and received); the routing of 2 steps is not
        assert 0.9 < run["sent_MiB_per_rank_per_step"] / run["planned_exchange_MiB"] < 1.1, row
        assert abs(run["predicted_peak_MiB"] / run["peak_MiB"] - 1) <= 0.05, row


# ----------------------------------------------------------------------------------------------- worker side

def _moe_args():
    from models.deepseek_v3.args import FLAVORS

    # small enough to be quick, the debug model's routing (8 experts, top-3, 2 shared experts)
    return dataclasses.replace(FLAVORS["debugmodel"], dim=64, moe_inter_dim=32)


def _init(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


class _Block(torch.nn.Module):
    """A residual MoE block: enough structure for activation checkpointing to wrap."""

    def __init__(self, args):
        from models.deepseek_v3.moe import MoE

        super().__init__()
        self.norm = torch.nn.RMSNorm(args.dim)
        self.moe = MoE(args)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class _Stack(torch.nn.Module):
    def __init__(self, args, n_layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): _Block(args) for i in range(n_layers)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _ep_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))


def _local_grad(p):
    g = p.grad
    return g.to_local() if hasattr(g, "to_local") else g


def _parity(mesh, rank: int) -> dict:
    """Max |deepep - alltoall| / max |alltoall| over the output and every gradient of one MoE layer."""
    from models.deepseek_v3.moe import MoE
    from parallelisms.expert_parallel import apply_expert_parallel

    args = _moe_args()
    result = {}
    for label, force_bf16_wire in (("fp32", False), ("bf16_wire", True)):
        torch.manual_seed(0)
        reference = MoE(args)
        _init(reference, 0)
        layers = {"alltoall": reference, "deepep": copy.deepcopy(reference)}
        outputs = {}
        for backend, moe in layers.items():
            apply_expert_parallel([moe], mesh, backend, args.dim, torch.float32)
            if backend == "deepep" and force_bf16_wire:
                moe.dispatcher._standin = False  # the real kernels' wire dtype, over the stand-in
            gen = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(2, 16, args.dim, generator=gen).requires_grad_(True)
            weight = torch.randn(2, 16, args.dim, generator=gen)
            out = moe(x)
            (out * weight).sum().backward()
            outputs[backend] = {"out": out.detach(), "x.grad": x.grad,
                                **{n: _local_grad(p) for n, p in moe.named_parameters()}}
        diffs = {}
        for name, want in outputs["alltoall"].items():
            got = outputs["deepep"][name]
            diffs[name] = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
        result[label] = diffs
    result["fp8_dispatch"] = {f"{backend}_{case}": _fp8_dispatch_parity(mesh, rank, backend, case)
                              for backend in ("deepep", "alltoall") for case in FP8_DISPATCH_CASES}
    return result


class _ExchangeSpy(TorchDispatchMode):
    """Records (dtype, shape) of the rows every functional all_to_all_single sends."""

    def __init__(self, sent: list):
        super().__init__()
        self.sent = sent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.sent.append([str(args[0].dtype), list(args[0].shape)])
        return func(*args, **(kwargs or {}))


#: plain: fp32; autocast: fp32 rows, experts computing in bf16 (autocast's), so the wire must quantise the rows
#: rounded to bf16 as the experts do; skewed: every token routed to the experts of the first EP ranks, so that the
#: last rank receives no row at all
FP8_DISPATCH_CASES = ("plain", "autocast", "skewed")


def _fp8_dispatch_parity(mesh, rank: int, backend: str, case: str) -> dict:
    """One MoE layer with blockwise FP8 experts on `backend`, rows sent as e4m3 vs in fp32, in one of
    `FP8_DISPATCH_CASES`: max |difference| of the output and every gradient (the experts quantise the same 1 x 128
    tiles, so 0), the rows this rank's experts received, and what went on the wire: the dtypes DeepEP's dispatch
    got, or every all-to-all's (dtype, shape), forward and backward."""
    from core.quantization import QUANTIZED_MM
    from models.deepseek_v3.moe import MoE
    from parallelisms.expert_parallel import apply_expert_parallel
    from quantization.fp8.gemms import Fp8GroupedMM

    args = dataclasses.replace(_moe_args(), dim=256, moe_inter_dim=128)  # FP8 tiles: multiples of 128
    torch.manual_seed(0)
    reference = MoE(args)
    _init(reference, 0)
    outputs, wire, received = {}, {}, []  # received: rows per run, fp32 wire then fp8
    original = deepep_cpu.Buffer.dispatch
    for label in ("fp32_wire", "fp8_wire"):
        moe = copy.deepcopy(reference)
        setattr(moe.experts, QUANTIZED_MM, Fp8GroupedMM("blockwise"))
        apply_expert_parallel([moe], mesh, backend, args.dim, torch.float32)
        if case == "skewed":  # selection only: no token picks the last EP rank's experts
            moe.expert_bias[-moe.dispatcher.num_local_experts:] = -1e4
        sent = []
        wire[label] = {"accepted": moe.dispatcher.quantize_wire(128) if label == "fp8_wire" else False, "sent": sent}
        dispatch = moe.dispatcher.dispatch

        def counted(*a, _dispatch=dispatch, _received=received):
            routed = _dispatch(*a)
            _received.append(int(routed.counts_E.sum()))
            return routed

        moe.dispatcher.dispatch = counted

        def spy(self, x, *a, _sent=sent, **kw):
            _sent.append(str(x[0].dtype) if isinstance(x, tuple) else str(x.dtype))
            return original(self, x, *a, **kw)

        deepep_cpu.Buffer.dispatch = spy
        try:
            with (_ExchangeSpy(sent) if backend == "alltoall" else contextlib.nullcontext(),
                  torch.autocast("cpu", torch.bfloat16, enabled=case == "autocast")):
                gen = torch.Generator().manual_seed(100 + rank)
                x = torch.randn(2, 16, args.dim, generator=gen).requires_grad_(True)
                out = moe(x)
                (out * torch.randn(out.shape, generator=gen)).sum().float().backward()
        finally:
            deepep_cpu.Buffer.dispatch = original
        outputs[label] = {"out": out.detach(), "x.grad": x.grad,
                          **{n: _local_grad(p) for n, p in moe.named_parameters()}}
    diffs = {name: (outputs["fp8_wire"][name] - want).abs().max().item()
             for name, want in outputs["fp32_wire"].items()}
    return {"max_abs_diff": diffs, "wire": wire, "received": received, "last_rank": rank == mesh.size() - 1}


def _ac_config(mode: str, save_deepep: bool = True, early_stop: bool = False):
    from parallelisms.activation_checkpoint.config import ActivationCheckpointSection
    from parallelisms.moe_comm.registry import op_table

    cfg = ActivationCheckpointSection(mode=mode, granularity="op", early_stop=early_stop)
    if not save_deepep:
        cfg.save_ops = [op for op in op_table().save_ops(cfg.save_ops) if not op.startswith("deepep")]
    return cfg


def _build(mesh, path: str, backend: str = "deepep"):
    from parallelisms.activation_checkpoint.policy import apply_ac
    from parallelisms.expert_parallel import apply_expert_parallel

    args = _moe_args()
    torch.manual_seed(0)
    model = _Stack(args, n_layers=2)
    _init(model, 0)
    moes = [layer.moe for layer in model.layers.values()]
    # sets the DeepEP buffer up eagerly, before tracking: not an activation
    apply_expert_parallel(moes, mesh, backend, args.dim, torch.float32)
    ac = {"full": _ac_config("full"), "full_early_stop": _ac_config("full", early_stop=True),
          "layer": dataclasses.replace(_ac_config("selective"), granularity="layer", layer_freq=1),
          "sac_saved": _ac_config("selective"), "sac_recomputed": _ac_config("selective", save_deepep=False)}
    if path in ac:
        apply_ac(model.layers, ac[path], {})
    return model, moes


class _LiveStorageBytes(TorchDispatchMode):
    """Bytes of the storages that ops create inside the block and that are still alive.

    MemTracker's accounting without its module hooks. Those hooks (torch 2.13) keep the autograd graph of a forward
    that raised alive for good, whatever the MoE backend (measured: the all-to-all backend grows ~160 kB per
    raising step under MemoryMonitor exact, like this one), so the exception path is measured with this instead.
    """

    def __init__(self):
        super().__init__()
        self._storages: dict[int, tuple[int, weakref.ref]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                storage = t.untyped_storage()
                self._storages.setdefault(storage._cdata, (storage.nbytes(), weakref.ref(storage)))
        return out

    def allocated_bytes(self) -> int:
        self._storages = {k: v for k, v in self._storages.items() if v[1]() is not None}
        return sum(nbytes for nbytes, _ in self._storages.values())


def _settle(patience_s: float = 1.0) -> None:
    """Let transient references go before a memory reading.

    gloo's worker threads drop their references to a collective's tensors shortly after the collective returns
    (measured: 1 step in 30 read 15 kB high without a 10 ms pause, none with it; on a loaded machine 10 ms was once
    not enough: 2 handles still referenced after the exception path's first step, none after the later ones);
    objects in reference cycles (the exact tracker's hooks make some, an exception's traceback others) wait for the
    cyclic collector. So: collect, and wait up to `patience_s` for the handles to go; a handle kept for good is
    still read as kept.
    """
    deadline = time.monotonic() + patience_s
    while True:
        time.sleep(0.01)
        gc.collect()
        if HANDLES.live_handles() == 0 or time.monotonic() > deadline:
            return


class _HostSyncs(TorchDispatchMode):
    """Counts host syncs as they would happen on a GPU: copies into host memory (the all-to-all dispatcher's split
    sizes, `.item()`), and DeepEP dispatches without a handle, which wait on the host for the received counts (a
    cached-mode dispatch, with a handle, knows them). A cached result that selective AC hands back in recompute
    reaches neither: no sync."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._dispatch = None

    def __enter__(self):
        original = self._dispatch = deepep_cpu.Buffer.dispatch

        def counted(buffer, x, handle=None, **kwargs):
            self.count += handle is None
            return original(buffer, x, handle=handle, **kwargs)

        deepep_cpu.Buffer.dispatch = counted
        return super().__enter__()

    def __exit__(self, *exc):
        deepep_cpu.Buffer.dispatch = self._dispatch
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from parallelisms.moe_comm.registry import op_table

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if op_table().kind(func, args, kwargs) == "d2h_copy":
            self.count += 1
        return func(*args, **kwargs)


SYNC_PATHS = ("none", "full", "layer", "sac_saved", "sac_recomputed", "full_plain")


def _host_syncs(mesh, rank: int) -> dict:
    """Host syncs in the forward and in the backward of a 2-layer EP stack, per backend and AC mode, and the
    largest difference of any gradient or the loss from the same stack without AC (bit-identical expected: the
    recompute reruns the forward's fp32 arithmetic, with the forward's routing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    result = {}
    for backend in ("alltoall", "deepep"):
        reference = None
        for path in SYNC_PATHS:
            model, moes = _build(mesh, "none" if path == "full_plain" else path, backend)
            if path == "full_plain":  # torch's checkpoint alone, without the split-size policy: must sync again
                for name, block in list(model.layers.items()):
                    model.layers[name] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            x = torch.randn(2, 16, moes[0].router.gate.weight.shape[1], generator=torch.Generator().manual_seed(rank))
            forward, backward = _HostSyncs(), _HostSyncs()
            with forward:
                loss = model(x).square().mean()
            with backward:
                loss.backward()
            values = [loss.detach()] + [_local_grad(p) for p in model.parameters()]
            reference = values if reference is None else reference
            diff = max((a - b).abs().max().item() for a, b in zip(values, reference))
            result[f"{backend}/{path}"] = [forward.count, backward.count, diff]
    return result


def _run_path(mesh, path: str, rank: int, patience_s: float = 1.0) -> dict:
    """STEPS steps of one execution path under exact memory tracking; what is alive after each step, read after
    waiting up to `patience_s` for the step's handles to go (`_settle`; 0 where they are kept for good)."""
    from trainer.memory.monitor import MemoryMonitor

    model, moes = _build(mesh, path)
    rec = {"allocated": [], "live_handles": [], "pending": [], "in_flight": [], "after_first_backward": []}
    if path == "exception":
        monitor = _LiveStorageBytes()
        read = monitor.allocated_bytes
    else:
        monitor = MemoryMonitor("cpu", "exact")
        monitor.track(model)

        def read():
            return monitor.step_end().allocated_bytes

    with monitor:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x1, x2 = (torch.randn(2, 16, moes[0].router.gate.weight.shape[1], generator=gen) for _ in range(2))
            _step(model, moes, path, x1, x2, rec)
            model.zero_grad(set_to_none=True)
            del x1, x2
            _settle(patience_s)
            rec["allocated"].append(read())
            rec["live_handles"].append(HANDLES.live_handles())
            rec["pending"].append(HANDLES.pending())
    return rec


class _Injected(RuntimeError):
    pass


def _step(model, moes, path: str, x1, x2, rec: dict) -> None:
    if path == "no_grad":
        model.eval()
        with torch.no_grad():
            model(x1)
        model.train()
    elif path == "inference_mode":
        with torch.inference_mode():
            model(x1)
    elif path == "microbatches":
        # two forwards before their backwards, the second backward first (a pipeline's 1F1B order)
        out1, out2 = model(x1), model(x2)
        rec["in_flight"].append(HANDLES.live_handles())
        out2.square().mean().backward()
        del out2
        rec["after_first_backward"].append(HANDLES.live_handles())
        out1.square().mean().backward()
    elif path == "exception":
        experts = moes[1].experts

        def boom(*args, **kwargs):
            raise _Injected("between dispatch and combine")

        experts.forward = boom
        try:
            model(x1).square().mean().backward()
        except _Injected:
            pass
        finally:
            del experts.forward
    else:
        model(x1).square().mean().backward()


def _api_checks(rank: int) -> dict:
    """DeepEP's Buffer contract, on the stand-in: tuple shapes and dtypes, masks, local ids, cached mode, combine."""
    import torch.distributed as dist

    group = dist.group.WORLD
    R, T, K, H = dist.get_world_size(), 10, 3, 16
    E = 4 * R
    E_local = E // R

    def routing(r):  # every rank can rebuild every rank's routing
        gen = torch.Generator().manual_seed(r)
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        idx[0] = -1  # a token that goes nowhere
        idx[1, 1] = -1  # a masked slot
        return idx, torch.rand(T, K, generator=gen) + 0.5

    def tokens(r):  # row t of rank r holds r * 1000 + t everywhere: received rows tell where they came from
        return (r * 1000 + torch.arange(T, dtype=torch.float32)).unsqueeze(1).expand(T, H).contiguous()

    cls = deepep_cpu.Buffer
    H_FP8 = deepep_cpu.FP8_BLOCK  # FP8 rows: one scale per 128 values
    widest = 2 * H_FP8 * 4  # the FP8 check's fp32 rows of two tiles
    hint = cls.get_dispatch_config(R).get_nvl_buffer_size_hint(widest, R)
    buffer = cls(group, max(hint, cls.get_combine_config(R).get_nvl_buffer_size_hint(widest, R)), 0)
    idx, w = routing(rank)
    x = tokens(rank)
    per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(idx, E)
    checks = {
        "layout": (per_rank.dtype == torch.int32 and per_rdma is None and per_expert.dtype == torch.int32
                   and in_rank.dtype == torch.bool and tuple(in_rank.shape) == (T, R)
                   and per_expert.tolist() == torch.bincount(idx[idx >= 0], minlength=E).tolist()
                   and not in_rank[0].any() and isinstance(event, deepep_cpu.EventOverlap)),
    }
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    event.current_stream_wait()
    src_rank, src_token = (recv_x[:, 0] // 1000).long(), (recv_x[:, 0] % 1000).long()
    want_idx, want_w = [], []
    for s, t in zip(src_rank.tolist(), src_token.tolist()):
        idx_s, w_s = routing(s)
        local = idx_s[t] - rank * E_local
        mine = (local >= 0) & (local < E_local)
        want_idx.append(torch.where(mine, local, -1))
        want_w.append(torch.where(mine, w_s[t], 0.0))
    checks["dispatch"] = (isinstance(counts, list) and all(isinstance(c, int) for c in counts)
                          and len(counts) == E_local and sum(counts) == int((recv_idx >= 0).sum())
                          and recv_idx.dtype == torch.int64 and recv_w.dtype == torch.float32
                          and torch.equal(recv_idx, torch.stack(want_idx)) and torch.equal(recv_w, torch.stack(want_w))
                          and torch.equal(handle[3].long(), src_token) and len(handle) == 6
                          and all(isinstance(t, torch.Tensor) for t in handle))
    cached = buffer.dispatch(x, handle=handle)
    checks["cached_dispatch"] = torch.equal(cached[0], recv_x) and cached[1:5] == (None,) * 4
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    copies = in_rank.sum(1, keepdim=True).float()  # combine sums without weights: one copy per rank visited
    checks["combine"] = (torch.equal(combined, x * copies) and torch.equal(combined_w, torch.where(idx >= 0, w, 0.0)))
    with_bias, none_w, _ = buffer.combine(recv_x, handle, bias=torch.ones(T, H))
    checks["combine_bias"] = torch.equal(with_bias, x * copies + 1) and none_w is None
    aligned = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=4)[3]
    checks["alignment"] = all(a % 4 == 0 and a - 4 < c <= a or a == c == 0 for a, c in zip(aligned, counts))
    checks["fp8_dispatch"] = _fp8_dispatch_checks(buffer, rank, (per_rank, in_rank, per_expert, idx, w), handle)
    rejected = []
    fp8_rows, fp8_scales = quantize(torch.randn(T, H_FP8), 1, H_FP8)
    for bad in (lambda: buffer.dispatch(x.half(), handle=handle), lambda: buffer.get_dispatch_layout(idx.int(), E),
                lambda: buffer.dispatch(x[:, :3].contiguous(), handle=handle),
                lambda: buffer.dispatch((fp8_rows, fp8_scales[:, :0].contiguous()), handle=handle),
                lambda: buffer.dispatch((fp8_rows.float(), fp8_scales), handle=handle)):
        try:
            bad()
        except (TypeError, ValueError):
            rejected.append(True)
    buffer.destroy()
    try:
        buffer.combine(recv_x, handle)
    except RuntimeError:
        rejected.append(True)
    checks["rejects"] = rejected == [True] * 6
    return checks


def _fp8_dispatch_checks(buffer, rank: int, layout: tuple, handle: tuple) -> bool:
    """DeepEP's FP8 dispatch on the stand-in: (e4m3 rows, fp32 scales per 1 x 128 tile) in, the same tuple out for
    the rows a plain dispatch of the dequantised values delivers, in layout and in cached mode."""
    per_rank, in_rank, per_expert, idx, w = layout
    T, H = idx.shape[0], deepep_cpu.FP8_BLOCK
    gen = torch.Generator().manual_seed(rank)
    # rows of very different magnitudes, so that every tile gets its own scale
    x = torch.randn(T, 2 * H, generator=gen) * torch.logspace(-3, 3, T).unsqueeze(1)
    rows, scales = quantize(x, 1, H)
    exact = dequantize(rows, scales, 1, H)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
              topk_weights=w)
    (recv_rows, recv_scales), *rest = buffer.dispatch((rows, scales), **kw)
    plain, *plain_rest = buffer.dispatch(exact, **kw)
    cached_rows, cached_scales = buffer.dispatch((rows, scales), handle=handle)[0]
    same_layout = (torch.equal(rest[0], plain_rest[0]) and torch.equal(rest[1], plain_rest[1])
                   and rest[2] == plain_rest[2])
    return (recv_rows.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
            and tuple(recv_scales.shape) == (plain.shape[0], 2) and same_layout
            and torch.equal(dequantize(recv_rows, recv_scales, 1, H), plain)
            and torch.equal(dequantize(cached_rows, cached_scales, 1, H), plain))


def _battery(rank: int) -> dict:
    import torch.distributed as dist

    mesh = _ep_mesh()
    result = {"api": _api_checks(rank), "parity": _parity(mesh, rank), "syncs": _host_syncs(mesh, rank),
              "paths": {}, "leak": {}}
    for path in PATHS:
        result["paths"][path] = _run_path(mesh, path, rank)
        dist.barrier()
    # the same checks must fail when handles are never released: entries stay in the registry for good
    original = HandleRegistry._pop
    for path in ("none", "no_grad"):
        HandleRegistry._pop = lambda self, handle_id: self._pending.get(handle_id)
        try:
            result["leak"][path] = _run_path(mesh, path, rank, patience_s=0.0)
        finally:
            HandleRegistry._pop = original
            HANDLES._pending.clear()  # what the patch kept
    return result


def _train(jobs: dict) -> dict:
    import torch.distributed as dist

    from trainer.job_config import load_config
    from trainer.memory.monitor import MemoryMonitor
    from trainer.train import run

    step_end = MemoryMonitor.step_end

    def settled_step_end(self):
        _settle()
        return step_end(self)

    MemoryMonitor.step_end = settled_step_end
    results = {}
    for name, args in jobs.items():
        history = []
        run(load_config(args), shutdown=False, history=history)
        results[name] = [{k: h[k] for k in TRAIN_KEYS if k in h} for h in history]
        dist.barrier()
    return results


def _handle_leak(job: dict) -> dict:
    """Train `job["args"]` with rank `job["rank"]`'s handle registry never releasing (as `_battery`'s leak); every
    rank's own live handles per step, and what rank 0's run folder holds of them."""
    import torch.distributed as dist

    from trainer.job_config import load_config
    from trainer.memory.leak_detector import HANDLES
    from trainer.memory.ranks import read_worst_ranks
    from trainer.metrics import read_scalars, run_dirs
    from trainer.train import run

    original = HandleRegistry._pop
    if dist.get_rank() == job["rank"]:
        HandleRegistry._pop = lambda self, handle_id: self._pending.get(handle_id)
    warnings = _Messages("trainer.memory.leak_detector", "handle leak")
    history: list[dict] = []
    try:
        run(load_config(job["args"]), shutdown=False, history=history)
    finally:
        HandleRegistry._pop = original
        deepep.HANDLES._pending.clear()  # what the patch kept
        logging.getLogger("trainer.memory.leak_detector").removeHandler(warnings)
    own = [None] * dist.get_world_size()
    dist.all_gather_object(own, [h["moe/live_handles"] for h in history])
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, warnings.messages)
    result = {"own": own, "warnings": said}
    if dist.get_rank() == 0:
        dump = job["args"][job["args"].index("--job.dump_folder") + 1]
        [run_dir] = run_dirs(os.path.join(dump, "tb"))
        scalars = read_scalars(run_dir)
        result |= {"max": [v for _, v in scalars["moe/live_handles/max"]],
                   "min": [v for _, v in scalars["moe/live_handles/min"]],
                   "worst": read_worst_ranks(run_dir)["moe/live_handles"],
                   "alarm": scalars.get(HANDLES.alarm_tag), "alarm_rank": scalars.get(HANDLES.alarm_rank_tag)}
    dist.barrier()
    return result


def _worker(jobs_path: str, out_path: str) -> None:
    import torch.distributed as dist
    from dist_worker import worker_session

    standin_logs = _StandinLogCounter()
    fp8_dispatch_logs = _Messages("models.deepseek_v3.parallelize", "fp8 dispatch")
    with worker_session(jobs_path, out_path) as (jobs, out):
        if jobs.get("battery"):
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, _battery(dist.get_rank()))
            out["battery"] = gathered
        out["train"] = _train(jobs.get("train", {}))
        if "handle_leak" in jobs:
            out["handle_leak"] = _handle_leak(jobs["handle_leak"])
        out["fp8_dispatch_logs"] = fp8_dispatch_logs.messages
        out["standin_logs"] = [None] * dist.get_world_size()
        dist.all_gather_object(out["standin_logs"], standin_logs.count)


class _Messages(logging.Handler):
    """The log messages of logger `name` (this process, INFO and up) that contain `text`."""

    def __init__(self, name: str, text: str):
        super().__init__()
        self.text, self.messages = text, []
        source = logging.getLogger(name)
        source.setLevel(logging.INFO)
        source.addHandler(self)

    def emit(self, record):
        if self.text in record.getMessage():
            self.messages.append(record.getMessage())


class _StandinLogCounter(logging.Handler):
    """Counts the DeepEP backend's "using the CPU stand-in" log records of this process (every rank, INFO)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        source = logging.getLogger(deepep.__name__)
        source.setLevel(logging.INFO)  # other ranks' root logger drops INFO
        source.addHandler(self)

    def emit(self, record):
        self.count += "CPU stand-in" in record.getMessage()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
