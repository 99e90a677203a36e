"""AdamW over all model parts, with fp32 master weights and state, optionally stepped in tiles.

Tiled step: torch's AdamW runs its multi-tensor (foreach) kernels once per parameter group, and the foreach
path allocates temporaries as large as the whole group (e.g. ``sqrt(exp_avg_sq)`` for every tensor of the group
at once). With a single group that is one extra copy of all parameters at the optimizer step, which is the
peak of a step whenever activations are small next to the weights (MoE: many large expert weights, small
batches). Splitting the parameters into groups of at most ``max_group_bytes`` caps that transient at one
group. The result is still a plain ``torch.optim.AdamW``: LR schedulers set ``lr`` on every group, and
``state_dict``/``load_state_dict``, DCP's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` and
``zero_grad`` work unchanged. Same idea as DeepSpeed-MoE's ``max_group_size`` cap on expert parameter groups
(DeepSpeed PR #2079), measured here in ``benchmarks/tiled_optimizer.py`` and ``docs/memory.md``.

BF16 moments (``state_dtype = "bfloat16"``): AdamW's two moments are stored in bfloat16 while the parameters (the
master weights) stay float32, as DeepSeek-V3 trains (technical report, section 3.3): 4 instead of 8 bytes of state
per parameter. torch's foreach and fused AdamW group tensors by dtype and cannot mix float32 parameters with
bfloat16 state, so ``BF16MomentsAdamW`` steps itself; see its docstring. The stored moments are rounded
stochastically by default (``state_rounding``, ``trainer/stochastic_rounding.py``): rounded to nearest, a moment
that moves by less than half a bfloat16 step per update stalls (at beta2 = 0.999, for example).
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from core.config import option
from trainer.stochastic_rounding import kernel_site, round_to_bf16, salt, shard_index_base, stochastic_round_


@dataclass
class OptimizerSection:
    """The optimizer and its hyperparameters."""

    name: str = option("AdamW", choices=["AdamW"])
    """Optimizer class."""
    lr: float = option(8e-4, gt=0)
    """Peak learning rate, reached at the end of warmup."""
    beta1: float = option(0.9, ge=0, lt=1)
    """Decay rate of the first-moment (mean) estimate."""
    beta2: float = option(0.95, ge=0, lt=1)
    """Decay rate of the second-moment (variance) estimate."""
    eps: float = option(1e-8, gt=0)
    """Added to the denominator for numerical stability."""
    weight_decay: float = option(0.1, ge=0)
    """Decoupled weight decay coefficient."""
    implementation: str = option("fused", choices=["foreach", "for-loop", "fused"])
    """Kernel strategy of the optimizer step: fused (one kernel per tensor, no step-wide temporaries; faster than
    foreach, see docs/performance.md), multi-tensor foreach, or one tensor at a time."""
    max_group_bytes: int = option(0, ge=0)
    """0 = step all parameters at once; >0 = tiled step over parameter groups of at most this many bytes,
    which caps the temporary memory of the foreach kernels (fused and for-loop have none to cap)."""
    state_dtype: str = option("float32", choices=["float32", "bfloat16"])
    """dtype of AdamW's two moments; the parameters (master weights) stay float32 either way. bfloat16, as
    DeepSeek-V3 trains, stores 4 instead of 8 bytes of state per parameter and moves 20 instead of 28 bytes per
    parameter in the step, whose math stays float32 (docs/memory.md, "BF16 optimizer moments"). A checkpoint of the
    other dtype resumes, converted."""
    state_rounding: str = option("stochastic", choices=["stochastic", "nearest"])
    """How bfloat16 moments are stored after each update (float32 moments are not rounded): stochastic (rounds up
    with probability equal to the remainder, so small updates survive on average; reproducible: the random bits
    hash the parameter's name, the seed, the step and the element's global index, so every layout and a resume
    round alike) or nearest (round to nearest even: cheaper off the compiled CUDA kernel, but a moment whose update
    is under half a bfloat16 step stalls; at beta2 = 0.999 a second moment stalls at 29% of its float32 value.
    docs/memory.md, "BF16 optimizer moments")."""


__all__ = ["BF16MomentsAdamW", "STATE_DTYPES", "adamw_foreach_step", "adamw_tensor_step", "build_optimizer",
           "grad_scale_in_kernel", "local_nbytes", "skippable_tensor_step", "store_moment", "tile_params"]

#: `optimizer.state_dtype` -> the moments' dtype
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MOMENTS = ("exp_avg", "exp_avg_sq")


def local_nbytes(p: torch.Tensor) -> int:
    """Bytes of the part of ``p`` this rank holds (the local shard of a DTensor), which is what the step touches."""
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.numel() * local.element_size()


def tile_params(params: list[torch.Tensor], max_group_bytes: int) -> list[list[torch.Tensor]]:
    """Split ``params`` in order into consecutive tiles of at most ``max_group_bytes`` local bytes each.

    A parameter larger than the limit gets a tile of its own (tensors are never split, so the step stays
    bit-identical to the untiled one). ``max_group_bytes <= 0`` returns one tile with everything.
    """
    if max_group_bytes <= 0:
        return [list(params)] if params else []
    tiles: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    current_bytes = 0
    for p in params:
        nbytes = local_nbytes(p)
        if current and current_bytes + nbytes > max_group_bytes:
            tiles.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    if current:
        tiles.append(current)
    return tiles


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def store_moment(dst: torch.Tensor, value: torch.Tensor, step: torch.Tensor, tag: int, rounding) -> None:
    """``dst`` (a stored moment) := float32 ``value``: rounded to nearest where ``rounding`` is None, else
    stochastically, eagerly a chunk at a time with ``rounding = (key, base)`` (the parameter's 0-d int64 key and
    the global index of its local part's first element, an int), or in one pass whose random bits cost no memory
    traffic (a compiled kernel) with ``rounding`` the parameter's ``kernel_site`` as an int64 tensor. ``tag`` tells
    the two moments apart."""
    if rounding is None:
        dst.copy_(value)
    elif isinstance(rounding, torch.Tensor):
        dst.copy_(round_to_bf16(value, rounding, step, tag))
    else:
        key, base = rounding
        stochastic_round_(dst, value, base, salt(key, step, tag))


def adamw_tensor_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      step: torch.Tensor, lr: torch.Tensor, beta1: float, beta2: float, eps: float,
                      weight_decay: float, rounding=None, grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW update of one tensor whose moments are stored in low precision; the math in float32.

    ``param``, ``grad``: float32; ``exp_avg``, ``exp_avg_sq``: the stored moments, updated in place; ``step``: the
    tensor's 0-d float32 step counter, incremented here; ``lr``: a 0-d float32 tensor; ``rounding``: how the moments
    are stored (``store_moment``); ``grad_scale``: a 0-d tensor the gradient is divided by first (clipping, or
    GradScaler's unscaling), as torch's fused AdamW does: not written back here (a compiled kernel saves the pass),
    so eagerly a gradient-sized temporary. The moments are upcast, updated, used for the parameter's update in
    float32 and stored rounded back: torch's AdamW with float32 state (same order of operations) but for the
    rounding of what is stored. The values that change from step to step (``lr``, ``step``, ``grad_scale``) are
    tensors, so that a compiled copy runs every step without recompiling.
    """
    if grad_scale is not None:
        grad = grad / grad_scale
    step.add_(1)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    param.mul_(1 - lr * weight_decay)
    m = exp_avg.to(torch.float32, copy=True).lerp_(grad, 1 - beta1)
    v = exp_avg_sq.to(torch.float32, copy=True).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    store_moment(exp_avg, m, step, 0, rounding)
    store_moment(exp_avg_sq, v, step, 1, rounding)
    denom = v.sqrt_().div_(bias_correction2_sqrt).add_(eps)
    param.sub_(m.div_(denom).mul_(lr / bias_correction1))


def adamw_foreach_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: torch.Tensor, beta1: float,
                       beta2: float, eps: float, weight_decay: float, roundings: list | None = None) -> None:
    """``adamw_tensor_step`` over lists of tensors of one device with torch's multi-tensor kernels (the same
    operations in the same order; the stochastic rounding, given ``roundings`` per tensor, one tensor at a time).
    The float32 copies of every listed tensor's moments exist at once."""
    torch._foreach_add_(steps, 1)
    bias_correction1 = torch._foreach_pow(beta1, steps)
    torch._foreach_neg_(bias_correction1)
    torch._foreach_add_(bias_correction1, 1)
    step_size = torch._foreach_div([lr] * len(steps), bias_correction1)
    bias_correction2_sqrt = torch._foreach_pow(beta2, steps)
    torch._foreach_neg_(bias_correction2_sqrt)
    torch._foreach_add_(bias_correction2_sqrt, 1)
    torch._foreach_sqrt_(bias_correction2_sqrt)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    ms = [m.to(torch.float32, copy=True) for m in exp_avgs]
    vs = [v.to(torch.float32, copy=True) for v in exp_avg_sqs]
    torch._foreach_lerp_(ms, grads, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
    if roundings is None:
        torch._foreach_copy_(exp_avgs, ms)
        torch._foreach_copy_(exp_avg_sqs, vs)
    else:
        for m, v, m32, v32, step, rounding in zip(exp_avgs, exp_avg_sqs, ms, vs, steps, roundings):
            store_moment(m, m32, step, 0, rounding)
            store_moment(v, v32, step, 1, rounding)
    torch._foreach_sqrt_(vs)
    torch._foreach_div_(vs, bias_correction2_sqrt)
    torch._foreach_add_(vs, eps)
    torch._foreach_div_(ms, vs)
    torch._foreach_mul_(ms, step_size)
    torch._foreach_sub_(params, ms)


def skippable_tensor_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                          step: torch.Tensor, lr: torch.Tensor, found_inf: torch.Tensor, grad_scale: torch.Tensor,
                          rounding=None, **hyperparameters) -> None:
    """``adamw_tensor_step`` that leaves every tensor as it was where the 0-d ``found_inf`` is nonzero: a
    non-finite step skipped on the device, without a host sync (the ``found_inf`` and ``grad_scale`` protocol of
    torch's fused AdamW and GradScaler). Meant to be compiled: there the saved values are loads of the same fused
    kernel, not copies, and dividing by ``grad_scale`` (1 where none is given) costs no pass of its own."""
    tensors = (param, exp_avg, exp_avg_sq, step)
    saved = [t.clone() for t in tensors]
    adamw_tensor_step(param, grad, exp_avg, exp_avg_sq, step, lr, rounding=rounding, grad_scale=grad_scale,
                      **hyperparameters)
    skip = found_inf != 0
    for t, old in zip(tensors, saved):
        t.copy_(torch.where(skip, old, t))


@functools.cache
def _compiled_tensor_step():
    # dynamic shapes and 1-D views: one graph serves every tensor (a second for 0/1-element ones at most)
    return torch.compile(skippable_tensor_step, dynamic=True, fullgraph=True)


def _compiles(device: torch.device) -> bool:
    """Whether the fused implementation runs the compiled kernel on `device` (elsewhere the eager step runs)."""
    return device.type == "cuda"


class BF16MomentsAdamW(torch.optim.AdamW):
    """AdamW with float32 parameters and bfloat16 moments (``optimizer.state_dtype = "bfloat16"``).

    Each tensor's moments are upcast, updated and used in float32, and stored rounded to bfloat16
    (``adamw_tensor_step``): the update is torch's AdamW with float32 state but for that rounding, stochastic or to
    nearest (``state_rounding``). Stochastic rounding draws its bits from a hash of the parameter's name (``names``,
    else its position), ``seed``, the step counter and the element's global index (``trainer/stochastic_rounding.py``):
    every layout, every kernel below and a resumed run round alike. Kernels, by ``implementation``:

    * ``fused``: one tensor at a time. On CUDA ``skippable_tensor_step`` compiled with torch.compile (1-D views,
      dynamic shapes, lr, step and ``found_inf`` as device tensors: one graph for every tensor and step), one fused
      kernel that reads and writes 20 bytes per parameter, as torchao's low-bit optimizers do. Elsewhere (CPU)
      ``adamw_tensor_step`` runs eagerly, like ``for-loop``: its float32 copies of one tensor's moments are the
      transient.
      Like torch's fused AdamW it takes ``found_inf`` and ``grad_scale`` (set as attributes, as GradScaler and the
      trainer do): a nonzero ``found_inf`` skips the step, on CUDA inside the kernel, elsewhere read on the host;
      the gradients are divided by ``grad_scale`` (the trainer's clipping: ``grad_scale_in_kernel``), on CUDA
      inside the kernel and not written back (torch's fused AdamW writes them back), elsewhere into a temporary.
      The other implementations refuse ``grad_scale``.
    * ``for-loop``: one tensor at a time, eagerly.
    * ``foreach``: torch's multi-tensor kernels per parameter group (``adamw_foreach_step``): float32 copies of the
      whole group's moments exist during its step, so tile with ``max_group_bytes``.

    It stays a ``torch.optim.AdamW``: LR schedulers, ``zero_grad``, ``state_dict`` and DCP work unchanged. The state
    of a DTensor parameter is a DTensor with the parameter's placements (DCP reshards it); the step works on the
    local shards. The step counters live on the parameters' device (no host sync). ``load_state_dict`` stores loaded
    moments in bfloat16, whatever dtype they come in (a float32-state checkpoint converts).
    """

    state_dtype = torch.bfloat16

    def __init__(self, params, implementation: str = "fused", state_rounding: str = "stochastic", seed: int = 0,
                 names: dict[torch.Tensor, str] | None = None, **hyperparameters):
        if implementation not in ("fused", "foreach", "for-loop"):
            raise ValueError(f"implementation {implementation!r}: allowed fused, foreach, for-loop")
        if state_rounding not in ("stochastic", "nearest"):
            raise ValueError(f"state_rounding {state_rounding!r}: allowed stochastic, nearest")
        super().__init__(params, foreach=False, fused=False, **hyperparameters)
        self.implementation = implementation
        self.state_rounding = state_rounding
        # per parameter: (key of its random bits, global index of its local part's first element)
        self._sites: dict[torch.Tensor, tuple[int, int]] = {}
        self._site_tensors: dict[torch.Tensor, torch.Tensor] = {}  # the above on the device, as used
        if state_rounding == "stochastic":
            params_in_order = [p for g in self.param_groups for p in g["params"]]
            for i, p in enumerate(params_in_order):
                name = (names or {}).get(p, str(i))
                base = shard_index_base(p)
                if base is None:
                    raise ValueError(f"optimizer.state_rounding = stochastic: parameter {name} is sharded as "
                                     f"{p.placements}, not along dim 0 only; allowed with it: nearest")
                self._sites[p] = (zlib.crc32(f"{seed}:{name}".encode()), base)
        self._step_supports_amp_scaling = implementation == "fused"  # it takes found_inf, as torch's fused does
        self._lrs: dict[torch.device, torch.Tensor] = {}  # a 0-d lr per device, refilled per group
        self._defaults: dict[tuple[str, torch.device], torch.Tensor] = {}  # found_inf 0 and grad_scale 1

    def _lr(self, device: torch.device, lr) -> torch.Tensor:
        if device not in self._lrs:
            self._lrs[device] = torch.zeros((), dtype=torch.float32, device=device)
        return self._lrs[device].fill_(lr)  # a kernel argument on CUDA: no host-to-device copy, no sync

    def _flag(self, name: str, device: torch.device, default: float) -> torch.Tensor:
        """The attribute `name` (`found_inf`, `grad_scale`) on `device` for the compiled step, `default` where none
        was given (a tensor: one graph either way)."""
        value = getattr(self, name, None)
        if value is not None:
            return value.to(device=device, dtype=torch.float32)
        if (name, device) not in self._defaults:
            self._defaults[name, device] = torch.full((), default, dtype=torch.float32, device=device)
        return self._defaults[name, device]

    @property
    def compiled(self) -> bool:
        """Whether the step runs the compiled kernel (``fused`` on CUDA), where ``found_inf`` and ``grad_scale`` cost
        no host read and no pass of their own."""
        return self.implementation == "fused" and any(_compiles(p.device) for g in self.param_groups
                                                      for p in g["params"])

    def _rounding(self, p: torch.Tensor, compiled: bool):
        """``rounding`` of ``store_moment`` for ``p``: None to nearest; else its key as a 0-d tensor on its device and
        its base, or for the compiled kernel its ``kernel_site`` as a tensor (one graph for every parameter)."""
        if self.state_rounding == "nearest":
            return None
        key, base = self._sites[p]
        if p not in self._site_tensors:
            local = _local(p)
            if compiled and local.numel() >= 1 << 32:
                raise ValueError(f"optimizer.state_rounding = stochastic: a local part of {local.numel()} elements, "
                                 "2^32 or more, is more than the compiled step rounds; shard the parameter or use "
                                 "optimizer.implementation = for-loop")
            self._site_tensors[p] = torch.tensor(kernel_site(key, base) if compiled else key, dtype=torch.int64,
                                                 device=local.device)
        return self._site_tensors[p] if compiled else (self._site_tensors[p], base)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            for key in MOMENTS:  # zeros_like keeps a DTensor's mesh and placements
                state[key] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None and self.implementation != "fused":
            raise RuntimeError(f"BF16MomentsAdamW with implementation {self.implementation} takes no grad_scale: "
                               "unscale the gradients first (GradScaler.unscale_)")
        found_inf = getattr(self, "found_inf", None)
        compiled = self.compiled
        if found_inf is not None and not compiled and found_inf.item():
            return loss  # off the compiled kernel the flag is read here: on CPU that costs no wait
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("BF16MomentsAdamW does not support sparse gradients")
            beta1, beta2 = group["betas"]
            hyper = dict(beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                         weight_decay=group["weight_decay"])
            states = [self._state(p) for p in params]
            tensors = [[_local(t) for t in (p, p.grad, s["exp_avg"], s["exp_avg_sq"])] + [s["step"]]
                       for p, s in zip(params, states)]
            if self.implementation == "foreach":
                by_device: dict[torch.device, list] = {}
                for param, ts in zip(params, tensors):
                    by_device.setdefault(ts[0].device, []).append(ts + [self._rounding(param, compiled=False)])
                for device, rows in by_device.items():
                    *lists, roundings = map(list, zip(*rows))
                    adamw_foreach_step(*lists, self._lr(device, group["lr"]), **hyper,
                                       roundings=None if self.state_rounding == "nearest" else roundings)
                continue
            for param, (p, g, m, v, step) in zip(params, tensors):
                lr = self._lr(p.device, group["lr"])
                if self.implementation == "fused" and _compiles(p.device):
                    if all(t.is_contiguous() for t in (p, g, m, v)):
                        # detached: dynamo guards on a view's base too, whose rank differs from tensor to tensor
                        p, g, m, v = (t.view(-1).detach() for t in (p, g, m, v))
                    _compiled_tensor_step()(p, g, m, v, step, lr, self._flag("found_inf", p.device, 0.0),
                                            self._flag("grad_scale", p.device, 1.0),
                                            rounding=self._rounding(param, compiled=True), **hyper)
                else:
                    adamw_tensor_step(p, g, m, v, step, lr, rounding=self._rounding(param, compiled=False),
                                      grad_scale=None if grad_scale is None else grad_scale.to(p.device), **hyper)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, except for the moments: stored in bfloat16 whatever their dtype in ``state_dict`` (torch
        would cast them to the parameters' float32, a float32 copy of the whole state at load), and the step
        counters as float32 on the parameters' device."""
        kept = {pid: {k: v for k, v in s.items() if k not in MOMENTS} for pid, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": kept})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = dict(zip(saved_ids, (p for g in self.param_groups for p in g["params"])))
        for pid, saved in state_dict["state"].items():
            state = self.state[params[pid]]
            for key in MOMENTS:
                if key in saved:
                    state[key] = saved[key].to(dtype=self.state_dtype, device=params[pid].device)
            if "step" in state:
                state["step"] = state["step"].to(dtype=torch.float32, device=_local(params[pid]).device)


def grad_scale_in_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s step divides the gradients by a ``grad_scale`` attribute inside its kernel: torch's
    fused AdamW (which writes the divided gradients back: a write instead of clipping's read and write) and the
    compiled BF16-moment step (which does not: no pass at all). Clipping by that division saves a pass over every
    gradient (``parallelisms/clip.py``)."""
    if isinstance(optimizer, BF16MomentsAdamW):
        return optimizer.compiled
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def build_optimizer(model_parts: list[nn.Module], cfg, seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over the parameters of every model part; `cfg` is the `[optimizer]` section.

    With ``cfg.max_group_bytes > 0`` the parameters are split into groups of at most that many bytes (see the
    module docstring); every group has the same hyperparameters. ``cfg.state_dtype = "bfloat16"`` gives a
    ``BF16MomentsAdamW`` (its stochastic rounding keyed by the parameters' names and ``seed``), float32 torch's own
    AdamW.
    """
    names = {p: name for part in model_parts for name, p in part.named_parameters() if p.requires_grad}
    params = list(names)
    groups = [{"params": tile} for tile in tile_params(params, cfg.max_group_bytes)]
    hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.state_dtype == "bfloat16":
        return BF16MomentsAdamW(groups, implementation=cfg.implementation, state_rounding=cfg.state_rounding,
                                seed=seed, names=names, **hyper)
    impl = {"foreach": dict(foreach=True), "for-loop": dict(foreach=False), "fused": dict(fused=True)}
    return torch.optim.AdamW(groups, **hyper, **impl[cfg.implementation])
