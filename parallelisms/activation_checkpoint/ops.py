"""The op table of activation checkpointing: the short op names `save_ops` takes and the ops they stand for.

The base entries are fixed here; each registered MoE comm backend adds the ops of its own kernels
(`TokenDispatcher.ac_ops`). An `OpTable` is derived from the backends registered when it is asked for
(`parallelisms.moe_comm.registry.op_table()`), so registering a backend changes no table in place, and a backend
registered in one test does not change another's defaults.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch

from core.names import resolve
from core.token_dispatch import TokenDispatcher

__all__ = ["BASE_COLLECTIVES", "BASE_OPS", "BASE_SAVE_OPS", "OpRef", "OpTable"]


@dataclasses.dataclass(frozen=True)
class OpRef:
    """One op by qualified name (`namespace.op.overload`), resolved lazily, optionally only when `when` holds.

    Lazy resolution lets the table name ops that a torch build or a library may lack: an op whose namespace is
    not registered resolves to None and has no effect. `when(args, kwargs)` narrows an op to some calls.
    """

    name: str
    when: Callable[[tuple, dict], bool] | None = None

    def resolve(self) -> torch._ops.OpOverload | None:
        """The OpOverload, or None while its library is not registered."""
        namespace, op, overload = self.name.split(".")
        try:
            return getattr(getattr(getattr(torch.ops, namespace), op), overload)
        except (AttributeError, RuntimeError):
            return None


def _off_host(args: tuple, kwargs: dict) -> bool:
    """The first argument is a tensor off the CPU (`.item()` of it is a device-to-host sync)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"


def _to_host(args: tuple, kwargs: dict) -> bool:
    """`_to_copy(x, device=cpu)`: a copy into host memory (`.cpu()`, `.to("cpu")`, `.tolist()` off the CPU).

    A CPU tensor's `.cpu()` dispatches nothing, so on CPU this matches only explicit copies
    (`.to("cpu", copy=True)`, `core.token_dispatch.host_list`): the dispatchers' syncs, as on a GPU.
    """
    dst = kwargs.get("device")
    return dst is not None and torch.device(dst).type == "cpu"


_SDPA = "aten._scaled_dot_product"

#: Short op names usable in `save_ops`, and the ops (resolved lazily) they stand for, before any comm backend's
#: (`OpTable` adds the registered backends' `TokenDispatcher.ac_ops`).
BASE_OPS: Mapping[str, tuple[OpRef, ...]] = MappingProxyType({
    # aten.linear is composite and reaches the dispatcher as mm/addmm in eager; listed for traced graphs.
    # FP8 GEMMs (quantization/fp8, torchao) count as their matmul kind; the _v2 ops are F.scaled_mm's (blockwise),
    # absent from older torch (resolved to None there). Our blockwise GEMMs reach the dispatcher as the custom ops
    # of quantization/fp8/scaled_gemms.py (registered when FP8 is on), which hide the aten ops inside them.
    "mm": (OpRef("aten.mm.default"), OpRef("aten.addmm.default"), OpRef("aten.bmm.default"),
           OpRef("aten.linear.default"), OpRef("aten._scaled_mm.default"), OpRef("aten._scaled_mm_v2.default"),
           OpRef("dsv3_fp8.scaled_mm_blockwise.default")),
    "grouped_mm": (OpRef("aten._grouped_mm.default"), OpRef("aten._scaled_grouped_mm.default"),
                   OpRef("aten._scaled_grouped_mm_v2.default"), OpRef("dsv3_fp8.blockwise_grouped_mm.default")),
    # Fused SDPA kernels. MLA's q/k head dim differs from v's, which the CPU flash kernel rejects: on CPU the model
    # pads v for flash in bf16 and takes the math path in fp32 (bmm and softmax: "mm" and "softmax").
    "attention": (OpRef(f"{_SDPA}_flash_attention_for_cpu.default"), OpRef(f"{_SDPA}_flash_attention.default"),
                  OpRef(f"{_SDPA}_efficient_attention.default"), OpRef(f"{_SDPA}_cudnn_attention.default"),
                  OpRef("aten._flash_attention_forward.default"), OpRef("aten._efficient_attention_forward.default")),
    "softmax": (OpRef("aten._softmax.default"), OpRef("aten._safe_softmax.default")),
    "all_to_all": (OpRef("_c10d_functional.all_to_all_single.default"),),
    "reduce_scatter": (OpRef("_c10d_functional.reduce_scatter_tensor.default"),),
    "all_gather": (OpRef("_c10d_functional.all_gather_into_tensor.default"),),
    "max": (OpRef("aten.max.default"), OpRef("aten.max.dim"), OpRef("aten.amax.default")),
    "topk": (OpRef("aten.topk.default"),),
    # Saved by every selective policy whether listed or not (see the module docstring).
    "d2h_copy": (OpRef("aten._to_copy.default", when=_to_host),
                 OpRef("aten._local_scalar_dense.default", when=_off_host)),
    "silu": (OpRef("aten.silu.default"),),
    "mul": (OpRef("aten.mul.Tensor"),),
    # The fused RMSNorm kernel (CUDA); on CPU nn.RMSNorm decomposes into pow/mean/rsqrt/mul and this is a no-op.
    "norm": (OpRef("aten._fused_rms_norm.default"),),
})

#: Save-list names that communicate: kept saved even inside recomputed modules (a backend's ops are added as well).
BASE_COLLECTIVES = frozenset({"all_to_all", "reduce_scatter", "all_gather"})

#: What selective AC saves by default ("default" in `save_ops`), before the registered backends' ops and the host
#: copies: the expensive compute and the collectives.
BASE_SAVE_OPS = ("mm", "grouped_mm", "attention", "all_to_all", "reduce_scatter", "max", "topk")

_KindIndex = dict[torch._ops.OpOverload, list[tuple[str, Callable | None]]]


class OpTable:
    """The op table of a set of MoE comm backends: `BASE_OPS` plus each backend's ops (as collectives).

    Built from the backends registered at the time it is asked for (`parallelisms.moe_comm.registry.op_table`),
    never changed afterwards. Resolves names to ops and ops to names (`kind`, an index built once per table:
    it runs for every op of every EP block under full AC).
    """

    def __init__(self, backends: Sequence[type[TokenDispatcher]] = ()):
        ops = dict(BASE_OPS)
        collectives = set(BASE_COLLECTIVES)
        for backend in backends:
            taken = [name for name in backend.ac_ops if name in ops]
            if taken:
                raise ValueError(f"{backend.__qualname__}.ac_ops: {', '.join(taken)} already in the activation "
                                 "checkpointing op table")
            ops.update({name: tuple(OpRef(q) for q in qualified) for name, qualified in backend.ac_ops.items()})
            collectives.update(backend.ac_ops)
        self.ops: Mapping[str, tuple[OpRef, ...]] = MappingProxyType(ops)
        self.collectives = frozenset(collectives)
        self.default_save_ops = (*BASE_SAVE_OPS, *(name for b in backends for name in b.ac_ops), "d2h_copy")
        self._index: _KindIndex | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.ops

    def resolve(self, name: str) -> list[torch._ops.OpOverload]:
        """The registered ops of entry `name` (unregistered ones are left out); ValueError if unknown."""
        if name not in self.ops:
            raise ValueError(f"unknown op name {name!r}; valid names: {', '.join(self.ops)}")
        return [op for op in (ref.resolve() for ref in self.ops[name]) if op is not None]

    def save_ops(self, names: Sequence[str]) -> list[str]:
        """`activation_checkpoint.save_ops` with "default" replaced by this table's default list."""
        return resolve(names, self.default_save_ops)

    def kind(self, op: torch._ops.OpOverload, args: tuple = (), kwargs: dict | None = None) -> str | None:
        """The entry that `op` called with args/kwargs falls under, or None."""
        if self._index is None:
            index: _KindIndex = collections.defaultdict(list)
            for name, refs in self.ops.items():
                for ref in refs:
                    resolved = ref.resolve()
                    if resolved is not None:
                        index[resolved].append((name, ref.when))
            self._index = dict(index)
        for name, when in self._index.get(op, ()):
            if when is None or when(args, kwargs or {}):
                return name
        return None
