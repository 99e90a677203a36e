"""Expert-parallel token routing with `all_to_all_single` over the EP process group.

dispatch: sort (token, expert) pairs by global expert id -> exchange per-expert counts (one small all-to-all)
  -> split sizes to the host (the one host sync per MoE layer) -> all-to-all the token rows and their routing
  weights (autograd versions, uneven splits) -> regroup the received rows by local expert.
combine: undo the regrouping -> reverse all-to-all -> back to token order -> sum over the top-k.

Everything a combine needs travels in the returned state, never on `self`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single_autograd

from core.token_dispatch import Dispatched, TokenDispatcher, host_list
from parallelisms.moe_comm.registry import register_comm_backend


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
        x_ND = x_TD[order_N // K]
        w_N = topk_weights_TK.reshape(-1)[order_N]

        # counts_recv[r, e]: rows rank r sends to my local expert e
        # functional (out-of-place) collective: activation checkpointing can save its output, so a recompute
        # never exchanges the counts again
        counts_recv = funcol.wait_tensor(funcol.all_to_all_single(num_tokens_per_expert, None, None, self.group))
        counts_recv_RE = counts_recv.view(self.ep, E_local)
        # the one device-to-host sync of EP: the collectives need split sizes on the host
        send_recv = torch.stack([num_tokens_per_expert.view(self.ep, E_local).sum(1), counts_recv_RE.sum(1)])
        send_splits, recv_splits = host_list(send_recv)

        x_recv = all_to_all_single_autograd(x_ND, recv_splits, send_splits, self.group)
        w_recv = all_to_all_single_autograd(w_N.unsqueeze(-1), recv_splits, send_splits, self.group).squeeze(-1)
        # received rows come (source rank, local expert)-major; the experts want local-expert-major
        expert_of_row = torch.repeat_interleave(
            torch.arange(E_local, device=x_TD.device).repeat(self.ep), counts_recv_RE.reshape(-1),
            output_size=sum(recv_splits))
        regroup_M = torch.argsort(expert_of_row, stable=True)
        state = AllToAllState(order_N, regroup_M, send_splits, recv_splits, T, K)
        return Dispatched(x_recv[regroup_M], w_recv[regroup_M], counts_recv_RE.sum(0), state)

    def combine(self, y_MD, state: AllToAllState):
        y_recv = y_MD[_inverse(state.regroup_M)]
        y_back = all_to_all_single_autograd(y_recv, state.send_splits, state.recv_splits, self.group)
        y_TKD = y_back[_inverse(state.order_N)].view(state.num_tokens, state.top_k, -1)
        return y_TKD.sum(dim=1)
