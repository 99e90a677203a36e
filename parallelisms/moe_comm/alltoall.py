"""Expert-parallel token routing with `all_to_all_single` over the EP process group.

dispatch: sort (token, expert) pairs by global expert id -> exchange per-expert counts (one small all-to-all)
  -> split sizes to the host (the one host sync per MoE layer) -> all-to-all the token rows and their routing
  weights (autograd versions, uneven splits) -> regroup the received rows by local expert.
  With `quantize_wire` (blockwise FP8 experts, `fp8.dispatch`), the token rows travel as e4m3 bytes and their fp32
  scales per 1 x block tile, quantised once per token before the rows are repeated for its top-k experts, and are
  dequantised on arrival; their gradients come back in the compute dtype.
combine: undo the regrouping -> reverse all-to-all -> back to token order -> sum over the top-k.

Everything a combine needs travels in the returned state, never on `self`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single_autograd

from core.token_dispatch import FP8_WIRE_DTYPE, Dispatched, TokenDispatcher, host_list
from parallelisms.moe_comm.registry import register_comm_backend
from quantization.fp8.quantize import dequantize, quantize


class AllToAllState(NamedTuple):
    """What `combine` needs to send rows back: the local sort, the regrouping, the split sizes."""

    order_N: torch.Tensor  # local sort of the T*K pairs by global expert id
    regroup_M: torch.Tensor  # received rows (by source rank, then expert) -> grouped by local expert
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    num_tokens: int
    top_k: int


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _exchange(t: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    """`t`'s rows to the ranks of `group`, in_splits[r] of them to rank r; out_splits[r] rows come from rank r
    (None: even splits). The functional (out-of-place) collective: activation checkpointing sees the op
    (`all_to_all`) and can save its output."""
    return funcol.wait_tensor(funcol.all_to_all_single(t.contiguous(), out_splits, in_splits, group))


class _Fp8Exchange(torch.autograd.Function):
    """Rows `rows_N` of x_TD to the EP ranks as e4m3 with one fp32 scale per 1 x `block` tile, returned in x's dtype.

    The tiles are the blockwise FP8 experts' own and the scales powers of two: x rounded to `source_dtype` (the
    dtype the experts quantise from) is quantised, the dequantised rows are exact in x's dtype, and the experts
    quantise them to the same e4m3 values they would make from x. Each token is quantised once, before its row is
    repeated for its top-k experts. The e4m3 values travel as `FP8_WIRE_DTYPE` bytes (gloo has no float8 type).
    The gradient passes straight through the quantisation and travels back in its own dtype, as DeepSeek-V3's
    backward combine does (bf16)."""

    @staticmethod
    def forward(ctx, x_TD, rows_N, recv_splits, send_splits, group, block, source_dtype):
        q_TD, scale_TB = quantize(x_TD.to(source_dtype), 1, block)
        q_recv = _exchange(q_TD.view(FP8_WIRE_DTYPE)[rows_N], recv_splits, send_splits, group)
        scale_recv = _exchange(scale_TB[rows_N], recv_splits, send_splits, group)
        ctx.save_for_backward(rows_N)
        ctx.splits, ctx.group, ctx.num_tokens = (recv_splits, send_splits), group, x_TD.shape[0]
        return dequantize(q_recv.view(q_TD.dtype), scale_recv, 1, block, x_TD.dtype)

    @staticmethod
    def backward(ctx, grad_MD):
        (rows_N,) = ctx.saved_tensors
        recv_splits, send_splits = ctx.splits
        grad_ND = _exchange(grad_MD, send_splits, recv_splits, ctx.group)
        # autograd's own gradient of x_TD[rows_N] (index_add_ sums a token's top-k rows in another order: in bf16
        # other bits than the unquantised path)
        grad_TD = grad_ND.new_zeros(ctx.num_tokens, grad_ND.shape[1]).index_put_((rows_N,), grad_ND, accumulate=True)
        return grad_TD, None, None, None, None, None, None


@register_comm_backend("alltoall")
class AllToAllDispatcher(TokenDispatcher):
    """Token dispatcher over an EP group of `ep` ranks; experts are split evenly and contiguously."""

    def __init__(self, group, num_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_local_experts = num_experts // self.ep

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK, num_tokens_per_expert):
        T, K = topk_idx_TK.shape
        E_local = self.num_local_experts
        order_N = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
        w_N = topk_weights_TK.reshape(-1)[order_N]

        # counts_recv[r, e]: rows rank r sends to my local expert e
        # saved by activation checkpointing (`_exchange`), so a recompute never exchanges the counts again
        counts_recv = _exchange(num_tokens_per_expert, None, None, self.group)
        counts_recv_RE = counts_recv.view(self.ep, E_local)
        # the one device-to-host sync of EP: the collectives need split sizes on the host
        send_recv = torch.stack([num_tokens_per_expert.view(self.ep, E_local).sum(1), counts_recv_RE.sum(1)])
        send_splits, recv_splits = host_list(send_recv)

        if self.fp8_block:
            x_recv = _Fp8Exchange.apply(x_TD, order_N // K, recv_splits, send_splits, self.group, self.fp8_block,
                                        self.fp8_source_dtype(x_TD))
        else:
            x_recv = all_to_all_single_autograd(x_TD[order_N // K], recv_splits, send_splits, self.group)
        w_recv = all_to_all_single_autograd(w_N.unsqueeze(-1), recv_splits, send_splits, self.group).squeeze(-1)
        # received rows come (source rank, local expert)-major; the experts want local-expert-major
        expert_of_row = torch.repeat_interleave(
            torch.arange(E_local, device=x_TD.device).repeat(self.ep), counts_recv_RE.reshape(-1),
            output_size=sum(recv_splits))
        regroup_M = torch.argsort(expert_of_row, stable=True)
        state = AllToAllState(order_N, regroup_M, send_splits, recv_splits, T, K)
        return Dispatched(x_recv[regroup_M], w_recv[regroup_M], counts_recv_RE.sum(0), state)

    @classmethod
    def can_quantize_wire(cls, block: int) -> bool:
        """FP8 dispatch in tiles of any width: the quantisation is this backend's own."""
        return block > 0

    def combine(self, y_MD, state: AllToAllState):
        y_recv = y_MD[_inverse(state.regroup_M)]
        y_back = all_to_all_single_autograd(y_recv, state.send_splits, state.recv_splits, self.group)
        y_TKD = y_back[_inverse(state.order_N)].view(state.num_tokens, state.top_k, -1)
        return y_TKD.sum(dim=1)
