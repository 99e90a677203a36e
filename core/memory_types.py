"""The types through which a model family describes its memory to the memory plan (`trainer/memory_plan.py`): the
tensors one block creates in forward, its backward working sets and FSDP units, and the model part of one rank.

A model spec's `memory_plan` hook returns a `StageMemory`; the plan sums it under the AC policy, the pipeline
schedule, FSDP and the optimizer.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BlockMemory", "Item", "Shape", "StageMemory"]


@dataclasses.dataclass(frozen=True)
class Item:
    """One tensor a block creates in forward: its bytes, whether autograd keeps it without AC, and its op."""

    name: str
    nbytes: int
    saved: bool  # kept for backward when the block is not checkpointed
    # producing op as named in `save_ops` ("input"; "other": ops no policy saves; "routing": what an EP dispatch
    # received that its recompute reuses, kept under AC by backends that do, `TokenDispatcher.recompute_reuses_routing`)
    op: str
    flops: int = 0  # forward FLOPs of the op that produces it (matmuls and attention; 0 for the rest)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimate needs about one forward of one microbatch."""

    B: int
    S: int
    act: int  # bytes per activation element (2 for bf16, 4 for fp32)
    device: str  # "cpu" or "cuda": which kernels run (e.g. attention with or without a score matrix)
    ep: int
    skew: float = 1.0  # rows the planned expert rank receives over the balanced mean (routing skew)
    cp: int = 1  # context-parallel degree: S is this rank's share of each sequence, S * cp the whole sequence
    #: bytes per element of the routed experts' inputs on the wire when they run in FP8 with FP8 dispatch (the comm
    #: backend's e4m3 and 1 x 128 tile scales); 0: dispatched in the compute dtype (`act`)
    fp8_dispatch_bytes: float = 0.0
    #: whether the comm backend's exchange op returns those rows dequantised (`TokenDispatcher.dequantizes_in_op`):
    #: selective activation checkpointing then saves them in the compute dtype, not as the wire's bytes
    fp8_dispatch_in_op: bool = False

    @property
    def T(self) -> int:
        return self.B * self.S


@dataclasses.dataclass(frozen=True)
class BlockMemory:
    """One block of a model part, for one microbatch, as the model package describes it."""

    layer: int
    items: list[Item]  # what the block creates in forward; items[0] is the block input
    ffn_saved: int  # saved bytes of the block's second half (the FFN), freed before the attention's backward
    attn_ws: int  # backward working set of the attention
    ffn_ws: int  # backward working set of the FFN (with any gradient all-to-all buffers)
    unit_bytes: int  # the block's parameters as FSDP gathers them (experts: this rank's EP share)
    unit_elements: int  # how many elements those are
    grad_bytes: int  # this rank's fp32 gradients of the block
    a2a_bytes: int = 0  # bytes of the block's forward exchanges, dispatch and combine (the larger of sent and received)
    a2a_grad_bytes: int = 0  # bytes of the backward's exchanges: both gradients, in the compute dtype
    fp8_gathered: int = 0  # elements of them FSDP gathers as FP8 blocks (1 byte and a 128 x 128 block's scale each)
    fp8_gathered_shard: int = 0  # this rank's shard of those: what each of its gathers quantises


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """What the plan needs about the model part of one rank (the model spec's `memory_plan` builds it).

    The embedding and head values are those of the model's; the plan counts them only where the part holds the
    first (`first`) or the last (`last`) pipeline unit.
    """

    blocks: list[BlockMemory]
    first: bool
    last: bool
    embedding_kept: int  # bytes the embedding keeps for backward
    embedding_unit_bytes: int  # the embedding as FSDP gathers it
    head_kept: int  # bytes the head (final norm, projection, log-softmax) keeps for backward
    head_unit_bytes: int
    head_grad_bytes: int  # this rank's fp32 gradients of the head
    logits: tuple[int, int]  # (rows, vocabulary) of one microbatch's logits
    hidden_bytes: int  # one hidden-state tensor of one microbatch
    largest_local_param: int  # fp32 bytes of this rank's largest parameter tensor
    buffer_bytes: int
    ep_buffers: int  # expert-parallel communication buffers (0 without EP)
    param_numel: int = 0  # this rank's parameters of the part (local FSDP / EP shards; rank 0 of its stage)
    head_flops: int = 0  # forward FLOPs of the output projection for one microbatch (0 without the head)
