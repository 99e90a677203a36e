"""Gradient clipping by the true global norm when parameters live on different device meshes.

`torch.nn.utils.clip_grad_norm_` stacks per-parameter norms, which fails when dense parameters (data-parallel
mesh) and experts (expert mesh) are DTensors on different meshes. Group by mesh, reduce each group to a full
(replicated) norm, add the squares, all-reduce over pipeline stages, and clip each group with the shared total.

Clipping in place is a pass over every gradient (read and write). An optimizer whose step kernel divides the
gradients by a ``grad_scale`` (torch's fused AdamW, the compiled BF16-moment step) can take the clipping instead:
``clip_grad_scale`` is that divisor, and the pass is saved.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "clip_grad_scale", "global_grad_norm"]

#: added to the norm before dividing, as torch's clip_grad_norm_ does
_EPS = 1e-6


def _by_mesh(params) -> dict:
    by_mesh = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    return by_mesh


def _global_norm(by_mesh: dict, pp_group) -> torch.Tensor:
    device = next((p.grad.device for ps in by_mesh.values() for p in ps), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for ps in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0, error_if_nonfinite=False, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


@torch.no_grad()
def global_grad_norm(params, pp_group=None) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` (over every mesh, and every pipeline stage of
    `pp_group`) as a plain fp32 0-d tensor; the gradients are left as they are."""
    return _global_norm(_by_mesh(params), pp_group)


def clip_grad_scale(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide the gradients by to clip them to `max_norm` (> 0): 1 / torch's clip coefficient,
    ``max((total_norm + 1e-6) / max_norm, 1)``, a 0-d tensor (no host sync)."""
    return ((total_norm + _EPS) / max_norm).clamp(min=1.0)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip in place to `max_norm` (0 = only measure) and return the global L2 norm as a plain fp32 tensor."""
    by_mesh = _by_mesh(params)
    total = _global_norm(by_mesh, pp_group)
    if max_norm > 0:
        for ps in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=True)
    return total
