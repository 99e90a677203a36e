"""Step-time model of the layout planner (`trainer.tools.plan`): seconds per optimizer step of one layout, from the
memory plan's per-rank work (FLOPs, FSDP units, all-to-all bytes) and the hardware inputs of `Hardware`.

It ranks layouts; it does not predict seconds until `Hardware` is calibrated on the user's GPUs (one measured step
time is enough: `python -m trainer.plan --calibrate-step-s S` fits `efficiency` so that the config's own layout
predicts S). docs/memory.md, "Layout planner", writes the model down:

    compute  = (3 x forward FLOPs + recompute FLOPs) x microbatches / (peak x efficiency), FP8 GEMMs at fp8 peak
               + the elementwise outputs activation checkpointing recomputes, memory-bound: 2 x their bytes (read
               and written) / (HBM bandwidth x elementwise_efficiency), per microbatch
    fp8      = the quantisation of every FP8 GEMM operand (forward x and W, dgrad dY and W^T, wgrad dY^T and x^T),
               memory-bound: elements x fp8_quantize_bytes / (HBM bandwidth x elementwise_efficiency), per microbatch;
               blockwise with autocast's cast weights (no FSDP) takes W^T as the forward's e4m3 W transposed: a
               read and a write of one byte per element instead
    bubble   = compute x the schedule's bubble fraction (GPipe/1F1B (p-1)/m, Interleaved1F1B (p-1)/(v m),
               ZBVZeroBubble (p-1)/(6 m), DualPipeV (p-2)/(3 m))
    fsdp     = all-gathers (forward, and backward again when resharding) + fp32 reduce-scatters of every unit, per
               microbatch, (s-1)/s of the bytes over NVLink or the network
    ep       = dispatch + combine token exchanges, forward, backward and any recompute replay, per MoE block and
               microbatch, (ep-1)/ep of the bytes; the part leaving the node over the network; with FP8 dispatch
               the forward's dispatch (and its replays) at 1 + 4/128 bytes per element
    cp       = all-gather of the compressed keys and values (forward, full-AC recompute) and reduce-scatter of their
               gradients (backward), per block and microbatch, (cp-1)/cp of the whole sequences' bytes
    pp       = the hidden state and its gradient, per microbatch and stage boundary
    hsdp     = all-reduce of the sharded fp32 gradients over the replicas, once per step
    optimizer= AdamW's memory traffic per local parameter over HBM: 28 bytes, 20 with bf16 moments; plus
               clipping's: 4 for the norm, 8 more in place, 4 with fused AdamW's write-back, none in the
               compiled bf16-moment step

    step = max(compute + fp8 + bubble, fsdp) + first all-gather + ep + cp + pp + hsdp + optimizer

FSDP overlaps with compute through prefetching; the MoE all-to-alls sit on the critical path of the MoE layer.
FP8 pays where its GEMMs save more than quantising their operands costs: the saving grows with a GEMM's three dims,
the quantisation with its operands' sizes, so small GEMMs (DeepSeek-V2-Lite's 1408-wide experts at 768 rows each)
lose and large ones (DeepSeek-V3's) gain (docs/performance.md, "What FP8 costs at each shape").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from parallelisms.moe_comm.registry import get_comm_backend
from quantization.fp8.accounting import fp8_flops_per_token, fp8_operand_elements
from quantization.fp8.config import fp8_selection

__all__ = ["Fp8Operands", "Hardware", "bubble_fraction", "fp8_operands", "recompute_seconds", "step_time"]


@dataclass(frozen=True)
class Hardware:
    """Every input of the step-time model. Defaults: H100 SXM nodes of 8 GPUs (NVLink 4, 400 Gb/s InfiniBand per
    GPU); the efficiencies are guesses until calibrated."""

    peak_tflops: float = 989.0
    """Dense bf16 TFLOP/s of one GPU (H100 SXM: 989)."""
    fp8_speedup: float = 1.6
    """FP8 GEMMs' speed over bf16's as reached in training: the rowwise FP8 GEMMs of the 671B-shape benchmark ran
    1.59x bf16's on an H200 (2026-11-27; the spec peaks' ratio is 2, the measured peaks' 1.79)."""
    efficiency: float = 0.45
    """Fraction of the peak the model's GEMMs and attention reach (fit it with --calibrate-step-s)."""
    nvlink_gbps: float = 450.0
    """GB/s one GPU sends over NVLink (H100 SXM: 900 GB/s both directions)."""
    network_gbps: float = 50.0
    """GB/s one GPU sends to other nodes (400 Gb/s InfiniBand per GPU)."""
    hbm_gbps: float = 3350.0
    """GB/s of device memory (H100 SXM: 3.35 TB/s): the optimizer step is memory-bound."""
    gpus_per_node: int = 8
    collective_efficiency: float = 0.8
    """Fraction of the link bandwidth NCCL's all-gather, reduce-scatter and all-reduce reach on large messages."""
    exchange_efficiency: float = 0.0
    """Fraction of the link bandwidth the MoE token exchange reaches; 0 = the comm backend's own figure
    (`TokenDispatcher.exchange_efficiency`: 0.5 for all_to_all_single with uneven splits, more for kernels built
    for it)."""
    fp8_quantize_bytes: float = 7.2
    """Effective bytes of memory traffic per quantised FP8 operand element: 5 by count (a pass for the tile maxima
    and a pass that scales and writes e4m3, each reading the bf16 value), 7.2 as measured: the rowwise step of the
    671B-shape benchmark on an H200 (2026-11-27) spent 47 ms in quantisation kernels where 5 bytes predict 33 ms.
    (Blockwise spent 73 ms there, and its per-expert GEMMs' host reads left the GPU idle 33 ms more.)"""
    elementwise_efficiency: float = 0.5
    """Fraction of the HBM bandwidth memory-bound elementwise kernels reach (a guess: the emulation's casts and
    elementwise kernels on the 2026-11-26 H200 profile moved about 40% of its peak by our byte count)."""

    def with_values(self, **values) -> "Hardware":
        """A copy with some inputs replaced."""
        return dataclasses.replace(self, **values)


def bubble_fraction(schedule: str | None, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Idle time of a pipeline rank over its busy time, for `microbatches` per step (0 without a pipeline)."""
    if schedule is None or pp == 1:
        return 0.0
    m = max(microbatches, 1)
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / m
    if schedule == "Interleaved1F1B":
        return (pp - 1) / (stages_per_rank * m)
    if schedule == "ZBVZeroBubble":
        # ZB-V fills most of the 1F1B bubble with the split-off weight-gradient passes
        return (pp - 1) / (6 * m)
    if schedule == "DualPipeV":
        # DeepSeek-V3's DualPipe bubble, (pp/2 - 1)(F&B + B - 3W), with F = W = 1 and B = 2 units of work
        return max(pp - 2, 0) / (3 * m)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _bandwidth(hw: Hardware, group: int, stride: int) -> float:
    """Bytes/s one rank sends in a collective over `group` ranks placed `stride` ranks apart: NVLink while the
    group fits in a node, else the network."""
    return (hw.nvlink_gbps if group * stride <= hw.gpus_per_node else hw.network_gbps) * 1e9


def _exchange_s(moved: float, ep: int, backend: str, hw: Hardware) -> float:
    """Seconds of MoE token exchanges of `moved` bytes in all over `ep` ranks ((ep-1)/ep of them leave the rank;
    the part leaving the node over the network)."""
    eff = hw.exchange_efficiency or get_comm_backend(backend).exchange_efficiency
    moved = moved * (ep - 1) / ep
    local = min(1.0, hw.gpus_per_node / ep)
    return (moved * local / (hw.nvlink_gbps * 1e9) + moved * (1 - local) / (hw.network_gbps * 1e9)) / eff


def _cp_s(nbytes: float, cp: int, hw: Hardware) -> float:
    """Seconds of context-parallel collectives of `nbytes` of whole sequences ((cp-1)/cp from other ranks; the
    context-parallel ranks are the world's innermost: NVLink while cp fits in a node)."""
    return nbytes * (cp - 1) / cp / (_bandwidth(hw, cp, 1) * hw.collective_efficiency)


def _elementwise_s(nbytes: float, hw: Hardware) -> float:
    """Seconds of memory-bound elementwise work writing `nbytes` (and reading as much)."""
    return 2 * nbytes / (hw.hbm_gbps * 1e9 * hw.elementwise_efficiency)


def recompute_seconds(op: str, flops: int, nbytes: int, dims, backend: str, hw: Hardware) -> float:
    """Seconds to recompute one tensor of the memory plan (`core.memory_types.Item`: its op, forward FLOPs and
    bytes) as `step_time` counts it: the token exchange (all_to_all) and the context-parallel all-gather as
    communication, a tensor with FLOPs at the GEMM rate, the received routing none (never made again: a backend
    that keeps it replays it, `TokenDispatcher.recompute_reuses_routing`), any other as elementwise work."""
    if op == "routing":
        return 0.0
    if op == "all_to_all":
        return _exchange_s(nbytes, dims.ep, backend, hw) if dims.ep > 1 else 0.0
    if op == "all_gather":
        return _cp_s(nbytes, dims.cp, hw) if dims.cp > 1 else 0.0
    if flops:
        return flops / (hw.peak_tflops * 1e12 * hw.efficiency)
    return _elementwise_s(nbytes, hw)


@dataclass(frozen=True)
class Fp8Operands:
    """What an FP8 recipe quantises on one rank (`fp8_operands`)."""

    elements_per_flop: float
    """Activation and output-gradient elements quantised per FP8 training FLOP."""
    weight_elements: float
    """Weight elements quantised per microbatch pass (each weight twice, W for forward and W^T for dgrad, or once
    where the dgrad takes the forward's e4m3 W transposed)."""
    weight_transposed_elements: float = 0.0
    """Weight elements per microbatch pass whose W^T is the forward's e4m3 W, transposed (a copy of 1 byte each)."""
    gathered_shard_elements: float = 0.0
    """The rank's shard of the FP8 weights FSDP gathers as blocks, which each gather quantises (the GEMMs quantise
    those weights no more: they are not in weight_elements)."""


_SHAPES: dict[tuple, tuple[tuple[str, tuple[int, ...]], ...]] = {}


def _param_shapes(model_cls, args) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter of `model_cls(args)`, from a meta-device build (once per args)."""
    key = (model_cls, repr(args))
    if key not in _SHAPES:
        with torch.device("meta"):
            model = model_cls(args)
        _SHAPES[key] = tuple((name, tuple(p.shape)) for name, p in model.named_parameters())
    return _SHAPES[key]


@dataclass(frozen=True)
class _Fp8Model:
    """What a model quantises under one FP8 selection, before it is shared out over ranks (`_fp8_model`)."""

    elements_per_flop: float
    linears: int
    experts: int
    stacked: int
    total: int


_FP8_MODELS: dict[tuple, _Fp8Model | None] = {}


def _fp8_model(spec, args, selection) -> _Fp8Model | None:
    """`_Fp8Model` of `spec.model_cls(args)` under `selection`, once per model and selection (the planner asks for
    every rank of thousands of layouts); None where the selection runs no FLOPs as FP8."""
    key = (spec.model_cls, repr(args), selection)
    if key not in _FP8_MODELS:
        table = spec.tools.module_flops(args)
        fp8_flops = fp8_flops_per_token(selection, table)
        shapes = _param_shapes(spec.model_cls, args)
        model = None
        if fp8_flops:
            activations, linears, experts = fp8_operand_elements(selection, table, shapes)
            model = _Fp8Model(activations / fp8_flops, linears, experts,
                              sum(math.prod(s) for _, s in shapes if len(s) > 2),
                              sum(math.prod(s) for _, s in shapes))
        _FP8_MODELS[key] = model
    return _FP8_MODELS[key]


def fp8_operands(spec, args, cfg, dims, work: dict) -> Fp8Operands | None:
    """The FP8 operands of one rank's microbatch (`work`: its memory plan's) for the `[fp8]` section of `cfg`; None
    with recipe none or a model without a per-module FLOPs table. The rank quantises the weights it holds gathered:
    the model's FP8 weights times the share of the model's parameters its stages hold (experts split over EP)."""
    if cfg.fp8.recipe == "none" or spec.tools.module_flops is None:
        return None
    fp8 = _fp8_model(spec, args, fp8_selection(cfg.fp8, spec.plan.module_defaults))
    if fp8 is None:
        return None
    model = fp8.total - fp8.stacked * (1 - 1 / dims.ep)
    held = sum(work["fsdp_unit_elements"]) if work["fsdp_unit_elements"] else work["param_count"]
    weights = min(1.0, held / model) * (fp8.linears + fp8.experts / dims.ep)
    # without FSDP, autocast casts every weight for its GEMM: blockwise keeps the forward's e4m3 W for the dgrad
    # (`quantization.fp8.gemms._keeps_weight`; DeepGEMM's experts, where installed, quantise W^T again: not modelled)
    if cfg.fp8.recipe == "blockwise" and cfg.training.dtype == "bfloat16" and not dims.sharded:
        return Fp8Operands(fp8.elements_per_flop, weights, weights)
    # weights FSDP gathers as blocks: the dgrad takes them transposed (a 1-byte copy), each gather quantises the
    # rank's shard
    gathered = min(work["fp8_gathered_elements"], weights)
    return Fp8Operands(fp8.elements_per_flop, 2 * (weights - gathered), weight_transposed_elements=gathered,
                       gathered_shard_elements=work["fp8_gathered_shard_elements"])


def step_time(dims, schedule: str | None, reshard: bool, accumulation: int, work: dict, fp8_fraction: float,
              backend: str, hw: Hardware, fp8: Fp8Operands | None = None) -> dict:
    """Seconds of one optimizer step on one rank, by part, for the memory plan's `work` of that rank
    (`trainer.tools.memory_plan.plan_rank`); `accumulation`: forward-backward passes per step without a pipeline
    (global batch over local batch times the data-parallel degree); `fp8`: what the FP8 recipe quantises (its
    FLOPs are `fp8_fraction` of the rank's). Besides the parts of the step: fp8_saved_s, the GEMM time FP8 saves
    over running its FLOPs in bf16, and fp8_quantize_weights_s, the weights' part of fp8_quantize_s."""
    passes = work["microbatches"] * accumulation
    peak = hw.peak_tflops * 1e12 * hw.efficiency
    flops = 3 * work["forward_flops"] + work["recompute_flops"]
    gemm_rate = ((1 - fp8_fraction) + fp8_fraction / hw.fp8_speedup) / peak
    recompute_elementwise = passes * _elementwise_s(work.get("recompute_memory_bytes", 0), hw)
    compute = passes * flops * gemm_rate + recompute_elementwise
    saved = passes * flops * fp8_fraction * (1 - 1 / hw.fp8_speedup) / peak
    quantize = weights = 0.0
    if fp8 is not None:
        per_element = hw.fp8_quantize_bytes / (hw.hbm_gbps * 1e9 * hw.elementwise_efficiency)
        # the transposed e4m3 copy writes one byte per element and reads as much
        weights = passes * (fp8.weight_elements * per_element + _elementwise_s(fp8.weight_transposed_elements, hw))
        # blocks FSDP gathers: every gather quantises this rank's shard of them
        weights += passes * (2 if reshard else 1) * fp8.gathered_shard_elements * per_element
        quantize = passes * fp8.elements_per_flop * fp8_fraction * flops * per_element + weights
    bubble = (compute + quantize) * bubble_fraction(schedule, dims.pp, work["microbatches"], work["stages_per_rank"])

    s = dims.fsdp_shard
    fsdp = first_gather = 0.0
    if work["fsdp_unit_bytes"]:
        bw = _bandwidth(hw, s, 1) * hw.collective_efficiency
        part = (s - 1) / s
        gathers = 2 if reshard else 1
        gather_bytes = sum(work["fsdp_unit_bytes"])
        grad_bytes = sum(work["fsdp_unit_elements"]) * 4  # the units' fp32 gradients, reduce-scattered
        fsdp = passes * (gathers * gather_bytes + grad_bytes) * part / bw
        first_gather = max(work["fsdp_unit_bytes"]) * part / bw

    ep = ep_again = 0.0
    if dims.ep > 1:
        ep = _exchange_s(passes * (work["a2a_bytes"] + work["a2a_grad_bytes"] + work["a2a_recomputed_bytes"]),
                         dims.ep, backend, hw)
        ep_again = _exchange_s(passes * work["a2a_recomputed_bytes"], dims.ep, backend, hw)

    cp = cp_again = 0.0
    if dims.cp > 1:
        cp = _cp_s(passes * (2 * work["cp_bytes"] + work["cp_recomputed_bytes"]), dims.cp, hw)
        cp_again = _cp_s(passes * work["cp_recomputed_bytes"], dims.cp, hw)

    pp = 0.0
    if dims.pp > 1:
        bw = _bandwidth(hw, 2, dims.world_size // dims.pp) * hw.collective_efficiency
        pp = passes * work["stages_per_rank"] * 2 * work["hidden_bytes"] / bw

    hsdp = 0.0
    if dims.dp_replicate > 1:
        r = dims.dp_replicate
        bw = _bandwidth(hw, r, s) * hw.collective_efficiency
        hsdp = 2 * (r - 1) / r * work["grad_bytes"] / bw

    optimizer = work["optimizer_bytes_per_param"] * work["param_count"] / (hw.hbm_gbps * 1e9)
    total = max(compute + quantize + bubble, fsdp) + first_gather + ep + cp + pp + hsdp + optimizer
    return {"step_s": total, "compute_s": compute, "fp8_quantize_s": quantize, "bubble_s": bubble, "fsdp_s": fsdp,
            "ep_s": ep, "cp_s": cp, "pp_s": pp, "hsdp_s": hsdp, "optimizer_s": optimizer, "fp8_saved_s": saved,
            "fp8_quantize_weights_s": weights,
            "recompute_s": passes * work["recompute_flops"] * gemm_rate + recompute_elementwise + ep_again + cp_again}
