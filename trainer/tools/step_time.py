"""Step-time model of the layout planner (`trainer.tools.plan`): seconds per optimizer step of one layout, from the
memory plan's per-rank work (FLOPs, FSDP units, all-to-all bytes) and the hardware inputs of `Hardware`.

It ranks layouts; it does not predict seconds until `Hardware` is calibrated on the user's GPUs (one measured step
time is enough: `python -m trainer.plan --calibrate-step-s S` fits `efficiency` so that the config's own layout
predicts S). docs/memory.md, "Layout planner", writes the model down:

    compute  = (3 x forward FLOPs + recompute FLOPs) x microbatches / (peak x efficiency), FP8 GEMMs at fp8 peak
    bubble   = compute x the schedule's bubble fraction (GPipe/1F1B (p-1)/m, Interleaved1F1B (p-1)/(v m),
               ZBVZeroBubble (p-1)/(6 m), DualPipeV (p-2)/(3 m))
    fsdp     = all-gathers (forward, and backward again when resharding) + fp32 reduce-scatters of every unit, per
               microbatch, (s-1)/s of the bytes over NVLink or the network
    ep       = dispatch + combine token exchanges, forward, backward and any recompute replay, per MoE block and
               microbatch, (ep-1)/ep of the bytes; the part leaving the node over the network
    cp       = all-gather of the compressed keys and values (forward, full-AC recompute) and reduce-scatter of their
               gradients (backward), per block and microbatch, (cp-1)/cp of the whole sequences' bytes
    pp       = the hidden state and its gradient, per microbatch and stage boundary
    hsdp     = all-reduce of the sharded fp32 gradients over the replicas, once per step
    optimizer= AdamW's memory traffic per local parameter over HBM: 28 bytes, 20 with bf16 moments

    step = max(compute + bubble, fsdp) + first all-gather + ep + cp + pp + hsdp + optimizer

FSDP overlaps with compute through prefetching; the MoE all-to-alls sit on the critical path of the MoE layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from parallelisms.moe_comm.registry import get_comm_backend

__all__ = ["Hardware", "bubble_fraction", "step_time"]


@dataclass(frozen=True)
class Hardware:
    """Every input of the step-time model. Defaults: H100 SXM nodes of 8 GPUs (NVLink 4, 400 Gb/s InfiniBand per
    GPU); the efficiencies are guesses until calibrated."""

    peak_tflops: float = 989.0
    """Dense bf16 TFLOP/s of one GPU (H100 SXM: 989)."""
    fp8_speedup: float = 2.0
    """FP8 GEMM peak over bf16 (H100: 1979 / 989)."""
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


def step_time(dims, schedule: str | None, reshard: bool, accumulation: int, work: dict, fp8_fraction: float,
              backend: str, hw: Hardware) -> dict:
    """Seconds of one optimizer step on one rank, by part, for the memory plan's `work` of that rank
    (`trainer.tools.memory_plan.plan_rank`); `accumulation`: forward-backward passes per step without a pipeline
    (global batch over local batch times the data-parallel degree)."""
    passes = work["microbatches"] * accumulation
    peak = hw.peak_tflops * 1e12 * hw.efficiency
    flops = 3 * work["forward_flops"] + work["recompute_flops"]
    compute = passes * flops * ((1 - fp8_fraction) + fp8_fraction / hw.fp8_speedup) / peak
    bubble = compute * bubble_fraction(schedule, dims.pp, work["microbatches"], work["stages_per_rank"])

    s = dims.fsdp_shard
    fsdp = first_gather = 0.0
    if work["fsdp_unit_bytes"]:
        bw = _bandwidth(hw, s, 1) * hw.collective_efficiency
        part = (s - 1) / s
        gathers = 2 if reshard else 1
        gather_bytes = sum(work["fsdp_unit_bytes"])
        grad_bytes = gather_bytes // work["unit_element_bytes"] * 4  # the units' fp32 gradients, reduce-scattered
        fsdp = passes * (gathers * gather_bytes + grad_bytes) * part / bw
        first_gather = max(work["fsdp_unit_bytes"]) * part / bw

    ep = 0.0
    if dims.ep > 1:
        eff = hw.exchange_efficiency or get_comm_backend(backend).exchange_efficiency
        moved = passes * (2 * work["a2a_bytes"] + work["a2a_recomputed_bytes"]) * (dims.ep - 1) / dims.ep
        local = min(1.0, hw.gpus_per_node / dims.ep)
        ep = (moved * local / (hw.nvlink_gbps * 1e9) + moved * (1 - local) / (hw.network_gbps * 1e9)) / eff

    cp = 0.0
    if dims.cp > 1:
        # the context-parallel ranks are the world's innermost: NVLink while cp fits in a node
        bw = _bandwidth(hw, dims.cp, 1) * hw.collective_efficiency
        cp = passes * (2 * work["cp_bytes"] + work["cp_recomputed_bytes"]) * (dims.cp - 1) / dims.cp / bw

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
    total = max(compute + bubble, fsdp) + first_gather + ep + cp + pp + hsdp + optimizer
    return {"step_s": total, "compute_s": compute, "bubble_s": bubble, "fsdp_s": fsdp, "ep_s": ep, "cp_s": cp,
            "pp_s": pp, "hsdp_s": hsdp, "optimizer_s": optimizer}
