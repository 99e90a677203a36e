"""Context parallelism: every sequence is split over the `cp` ranks of a context-parallel group.

The split is load-balanced for causal attention: the sequence is cut into 2 * cp equal chunks and rank i holds
chunks i and 2 * cp - 1 - i, so every rank's queries see the same number of keys (chunk i's queries attend to i + 1
chunks, chunk 2 * cp - 1 - i's to 2 * cp - i: 2 * cp + 1 chunks of keys per rank).

What travels: a model gathers what its attention needs of the other ranks' tokens with `gather` (an all-gather
whose backward is a reduce-scatter of the gradient). The ranks hold the whole sequence's token ids and labels (a few
bytes per token) and each model part takes its own share with `shard`, so that shifts along the sequence
(multi-token prediction's future tokens and labels) are taken on the whole sequence first and never cross a chunk
border wrongly.

The group is the innermost factor of the world (parallelisms/mesh.py): on a GPU cluster the context-parallel
ranks sit in one node, where the all-gather of every attention layer runs over NVLink.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

__all__ = ["ContextParallel", "own_share", "sequence_order"]

# torch 2.13 deprecates the old name for the new one (same signature); a torch without the new name has the old
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class ContextParallel:
    """One rank's place in its context-parallel group: which chunks of every sequence it holds, and the
    collectives that join them.

    group: the process group of the `degree` ranks that split each sequence; rank: this rank's index in it.
    """

    def __init__(self, group, degree: int, rank: int):
        if degree < 2:
            raise ValueError(f"context parallelism needs 2 or more ranks, got {degree}")
        self.group, self.degree, self.rank = group, degree, rank
        self.chunks = (rank, 2 * degree - 1 - rank)
        """The indices of this rank's two chunks among the 2 * degree chunks of a sequence."""
        self._order = sequence_order(degree)

    @classmethod
    def of_meshes(cls, meshes) -> "ContextParallel | None":
        """The context-parallel place of this rank in `meshes` (parallelisms/mesh.py), or None when cp = 1."""
        if meshes is None or meshes.cp is None:
            return None
        return cls(meshes.cp.get_group(), meshes.cp.size(), meshes.cp.get_local_rank())

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of `t` along `dim` (a whole sequence: its length a multiple of 2 * degree)."""
        parts = t.chunk(2 * self.degree, dim)
        return torch.cat([parts[c] for c in self.chunks], dim)

    def gather(self, t_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's share `t_local` along `dim`, in sequence order; differentiable
        (backward: reduce-scatter of the gradient to the ranks' shares)."""
        moved = t_local.movedim(dim, 0).contiguous()
        # waited at once: collectives left pending on gloo crashed processes (tests/test_comm_backends.py)
        gathered = funcol.wait_tensor(_all_gather_autograd(moved, 0, self.group))
        parts = gathered.chunk(2 * self.degree, 0)  # rank-major: rank r's chunks sit at 2r and 2r + 1
        return torch.cat([parts[i] for i in self._order], 0).movedim(0, dim)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over the group, not differentiable (statistics such as per-sequence expert counts)."""
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t

    def attention(self, q_BHLd: torch.Tensor, k_BHSd: torch.Tensor, v_BHSv: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries (its two chunks, [B, H, S / degree, d]) over the whole
        sequence's keys and values ([B, H, S, .], from `gather`).

        Without `mask`, each chunk attends to the keys up to its own end only (no score of a later key is
        computed), under a lower-right causal mask: on CUDA torch's `causal_lower_right` bias, which the fused
        kernels apply without building a mask; elsewhere, and under the exact memory tracker (whose dispatch mode
        the bias, a tensor subclass, cannot be created under), a boolean [chunk, end] tensor (the CPU kernels
        build the score matrix anyway). With a boolean `mask` [B, 1, S / degree, S] (document masking: this
        rank's rows of the whole sequence's mask), one masked call.
        """
        if mask is not None:
            return F.scaled_dot_product_attention(q_BHLd, k_BHSd, v_BHSv, attn_mask=mask, scale=scale)
        chunk = q_BHLd.shape[-2] // 2
        outs = []
        for q_chunk, index in zip(q_BHLd.split(chunk, dim=-2), self.chunks):
            end = (index + 1) * chunk
            causal = _lower_right_bias(chunk, end) if q_chunk.device.type == "cuda" else None
            if causal is None:
                causal = torch.ones(chunk, end, dtype=torch.bool, device=q_chunk.device).tril(end - chunk)
            outs.append(F.scaled_dot_product_attention(q_chunk, k_BHSd[..., :end, :], v_BHSv[..., :end, :],
                                                       attn_mask=causal, scale=scale))
        return torch.cat(outs, dim=-2)


def own_share(context_parallel: ContextParallel | None, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's share of `t`, whole sequences along `dim`: all of it without context parallelism."""
    return t if context_parallel is None else context_parallel.shard(t, dim)


def _lower_right_bias(rows: int, keys: int):
    """torch's lower-right causal bias, or None where it cannot be created: the tensor subclass fails under a
    dispatch mode that already holds its raw tensor (the exact memory tracker's)."""
    try:
        return causal_lower_right(rows, keys)
    except RuntimeError:
        return None


def sequence_order(degree: int) -> tuple[int, ...]:
    """Positions in the rank-major gathered chunks (rank r's at 2r, 2r + 1) of the sequence's chunks 0..2cp-1."""
    order = []
    for chunk in range(2 * degree):
        order.append(2 * chunk if chunk < degree else 2 * (2 * degree - 1 - chunk) + 1)
    return tuple(order)
