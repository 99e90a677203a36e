"""Gradient clipping by the true global norm when parameters live on different device meshes.

`torch.nn.utils.clip_grad_norm_` stacks per-parameter norms, which fails when dense parameters (data-parallel
mesh) and experts (expert mesh) are DTensors on different meshes. Group by mesh, reduce each group to a full
(replicated) norm, add the squares, all-reduce over pipeline stages, and clip each group with the shared total.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip in place to `max_norm` (0 = only measure) and return the global L2 norm as a plain fp32 tensor."""
    by_mesh = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    device = next((p.grad.device for ps in by_mesh.values() for p in ps), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for ps in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0, error_if_nonfinite=False, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        for ps in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=True)
    return total
