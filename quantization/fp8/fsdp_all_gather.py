"""FSDP2 all-gathers blockwise FP8 weights as e4m3 blocks: each rank quantises its own shard, and the GEMMs take the
gathered blocks as they are.

W's 128 x 128 blocks do not straddle a shard when FSDP's dim-0 shard holds whole blocks, so quantising the shard
and gathering the e4m3 values and fp32 scales gives every rank the blocks that quantising the gathered weight would
(bit for bit: the shard is first cast to FSDP's param dtype, as FSDP would for the gather). The gather then moves 1
byte per element (plus one fp32 scale per 16,384) instead of the param dtype's 2 or 4; each rank quantises 1/world of
the weight instead of all of it; the forward multiplies the gathered blocks, and the dgrad the same blocks
transposed (`WeightBlocks.transposed`), so the backward quantises no weight at all.

The two tensor subclasses, through FSDP2's all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`):
- `Fp8GatheredWeight` wraps a selected module's high-precision parameter (the master weight) before `fully_shard`:
  FSDP shards it, the optimizer, gradient clipping and checkpoints see its inner tensor (every op but those that
  FSDP needs to shard it returns plain tensors), and its pre-all-gather quantises the shard.
- `Fp8WeightBlocks` is the gathered, unsharded parameter the module's forward reads: nominally a tensor of the
  param dtype and W's shape, holding the e4m3 values and scales only, which the FP8 GEMMs take
  (`gemms._weight_and_blocks`). Its gradient is a plain tensor of the param dtype, which FSDP reduce-scatters as usual.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map_only

from quantization.fp8.quantize import BLOCK, quantize_weight_blocks

__all__ = ["Fp8GatheredWeight", "Fp8WeightBlocks", "gather_as_blocks", "gathers_blocks"]

aten = torch.ops.aten

#: the ops that FSDP2 shards a parameter with, and that moving or materialising a module (`to_empty`, `.to`) apply:
#: their results stay `Fp8GatheredWeight`s; every other op returns plain tensors
_KEEPS_WRAPPER = {aten.detach.default, aten.view.default, aten.as_strided.default, aten.slice.Tensor,
                  aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.narrow.default,
                  aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.clone.default,
                  aten.copy_.default, aten._to_copy.default, aten._pin_memory.default}


def gathers_blocks(shape: torch.Size | tuple[int, ...], shard_dim_size: int) -> bool:
    """Whether a weight [..., N, K] sharded on dim 0 over `shard_dim_size` ranks can be gathered as blocks: every
    shard holds whole 128 x 128 blocks (2-D: N a multiple of 128 x the ranks; a stack of experts: whole experts of
    N and K multiples of 128). FSDP gathers nothing over one rank: there the weight stays as it is."""
    *lead, N, K = shape
    if shard_dim_size < 2 or N % BLOCK or K % BLOCK:
        return False
    rows = lead[0] if lead else N // BLOCK
    return rows % shard_dim_size == 0


class Fp8GatheredWeight(torch.Tensor):
    """A high-precision weight (shard) that FSDP2 all-gathers as e4m3 128 x 128 blocks (`Fp8WeightBlocks`).

    compute_dtype: the dtype the GEMMs cast the gathered weight to before quantising it, where that is not FSDP's
    param dtype (the routed experts compute in bf16 on CUDA and under torch.compile, whatever the param dtype);
    None: the param dtype. The shard is cast the same way, so its blocks are the bits the GEMMs would quantise.
    """

    _tensor: torch.Tensor
    compute_dtype: torch.dtype | None

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, compute_dtype: torch.dtype | None = None):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.shape, strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   device=tensor.device, layout=tensor.layout,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, compute_dtype: torch.dtype | None = None):
        self._tensor, self.compute_dtype = tensor, compute_dtype

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        keeps = func in _KEEPS_WRAPPER
        # looked up only for the ops whose results stay wrapped: the optimizer's run every step
        dtype = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Fp8GatheredWeight)).compute_dtype \
            if keeps else None
        args, kwargs = tree_map_only(Fp8GatheredWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return tree_map_only(torch.Tensor, lambda t: Fp8GatheredWeight(t, dtype), out) if keeps else out

    def __tensor_flatten__(self):
        return ["_tensor"], self.compute_dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, compute_dtype, outer_size, outer_stride):
        return Fp8GatheredWeight(inner_tensors["_tensor"], compute_dtype)

    def __repr__(self):
        return f"Fp8GatheredWeight({self._tensor!r}, compute_dtype={self.compute_dtype})"

    def _stable_hash_for_caching(self) -> str:
        # AOT autograd's cache key (torch 2.13): the wrapper holds its inner tensor and the compute dtype
        return _metadata(f"Fp8GatheredWeight[{self.compute_dtype}]", self._tensor)

    def __reduce_ex__(self, protocol):
        # saved (checkpoints, torch.save) as the plain tensor it wraps: loadable with weights_only and without
        # this module, into any layout and recipe
        return self._tensor.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The shard's blocks, cast as FSDP and the GEMMs would cast it: (e4m3 values, fp32 scales), gathered along
        dim 0."""
        w = self._tensor.to(mp_policy.param_dtype or self.dtype)
        blocks = quantize_weight_blocks(w if self.compute_dtype is None else w.to(self.compute_dtype))
        return (blocks.q, blocks.scale), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered weight as `Fp8WeightBlocks` over the gathered buffers (which FSDP refills in place for the
        next gather: then `out`, the parameter made at the first one, already views them)."""
        q, scale = all_gather_outputs
        if out is not None:
            return None
        return Fp8WeightBlocks(q, scale, param_dtype), (q, scale)


class Fp8WeightBlocks(torch.Tensor):
    """An unsharded weight [..., N, K] of nominal dtype `dtype`, held as e4m3 values and one fp32 scale per
    128 x 128 block only (`q`, `scale`): the operand FP8 GEMMs take. It cannot be computed with otherwise."""

    q: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, strides=q.stride(), dtype=dtype, device=q.device,
                                                   requires_grad=False)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.q, self.scale = q, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # FSDP views the gathered parameter with its own shape and strides, and nn.Parameter detaches it
        if func in (aten.detach.default, aten.as_strided.default, aten.view.default, aten.alias.default):
            w = args[0]
            if tuple(func(torch.empty_like(w.q, device="meta"), *args[1:], **(kwargs or {})).shape) != \
                    tuple(w.shape):
                raise NotImplementedError(f"{func} changes the shape of FP8 weight blocks")
            return Fp8WeightBlocks(w.q, w.scale, w.dtype)
        raise NotImplementedError(f"{func} on FP8 weight blocks: only FP8 GEMMs take them (quantization/fp8/gemms.py)")

    def __tensor_flatten__(self):
        return ["q", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return Fp8WeightBlocks(inner_tensors["q"], inner_tensors["scale"], dtype)

    def __repr__(self):
        return f"Fp8WeightBlocks(shape={tuple(self.shape)}, dtype={self.dtype})"

    def _stable_hash_for_caching(self) -> str:
        return _metadata(f"Fp8WeightBlocks[{self.dtype}]", self.q, self.scale)


def _metadata(name: str, *tensors: torch.Tensor) -> str:
    """A subclass's name and its inner tensors' layouts (not their values), as a compile cache's key takes them."""
    return name + "".join(f"({t.dtype}, {tuple(t.shape)}, {tuple(t.stride())}, {t.device.type})" for t in tensors)


def gather_as_blocks(module: nn.Module, name: str, shard_size: int, compute_dtype: torch.dtype | None = None) -> bool:
    """Make `module`'s parameter `name` (a plain tensor, or a DTensor sharded over expert parallelism) an
    `Fp8GatheredWeight` (of `compute_dtype`, see there) before `fully_shard` shards it over `shard_size` ranks,
    where every shard holds whole blocks (`gathers_blocks`); returns whether it did."""
    param = getattr(module, name)
    local = param.to_local() if isinstance(param, DTensor) else param.data
    if isinstance(local, Fp8GatheredWeight) or not gathers_blocks(local.shape, shard_size):
        return False
    wrapped = Fp8GatheredWeight(local.detach(), compute_dtype)
    if isinstance(param, DTensor):
        wrapped = DTensor.from_local(wrapped, param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
    setattr(module, name, nn.Parameter(wrapped, requires_grad=param.requires_grad))
    return True
