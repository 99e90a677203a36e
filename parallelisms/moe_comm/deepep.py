"""DeepEP token dispatcher: DeepEP V1 `Buffer` kernels behind the TokenDispatcher interface.

Path of the tokens (one MoE layer, EP group of R ranks, E experts, E/R local):
    dispatch: x to the wire dtype -> torch.ops.deepep.dispatch (layout, then DeepEP dispatch: each token once
      to every rank owning one of its experts; returns received tokens, their local top-k ids and weights,
      per-expert counts and a handle id) -> expand each received token once per local expert it chose, grouped
      by local expert (the experts' layout). With `quantize_wire` (the blockwise FP8 recipe), x travels as e4m3
      with one fp32 scale per 1 x 128 tile, as DeepEP's FP8 dispatch takes it (DeepSeek-V3 does the same), and
      is dequantised on arrival; the backward (a combine) stays in the compute dtype.
    combine: sum the expanded rows back per received token -> torch.ops.deepep.combine (rows home, summed per
      token, no weights: the MoE multiplied them in already)

Three pieces of process-wide state, each behind one owner:
  * `BufferManager` (`BUFFERS`): the DeepEP buffer of the EP group, sized from DeepEP's own hints, created
    eagerly by `DeepEPDispatcher.setup` (or lazily, outside every dispatch mode, on first use).
  * `HandleRegistry` (`HANDLES`): DeepEP handles between a dispatch and its combine, keyed by an int id that
    travels through the custom ops as a CPU int64 tensor (ops pass only tensors).
  * the custom ops `deepep::dispatch` / `deepep::combine`, which the backend contributes to the activation
    checkpointing op table as "deepep_dispatch" / "deepep_combine" (`DeepEPDispatcher.ac_ops`), so that selective
    AC can save them.

Where it runs: with the real `deep_ep.Buffer` on NCCL groups (a CUDA run; without an importable `deep_ep` the
config check stops the run before launch), and with the CPU stand-in `deepep_cpu.Buffer` on gloo groups (a CPU
run; the log says so once). Other process-group backends are refused.

Handle lifecycle (docs/deepep.md has the history, torchtitan #2273/#2296): a registry entry lives from a dispatch
to its combine, never longer, and the autograd graph owns the handle after that.
  * training: combine's autograd setup *takes* the entry into its node; dispatch's node got the same handle at
    its own setup. Each backward drops its reference when it has used it, so after the step nothing is left.
  * no_grad / inference_mode / eval: nothing will run backward. The caller decides this *outside* the op
    (`will_backward = torch.is_grad_enabled() and y.requires_grad`, like torchtitan HEAD): inside a custom op
    grad mode is always off, so the op could not tell. combine releases the entry itself when False.
  * recompute (full AC, or SAC recomputing these ops): the forward's dispatch recorded its handle and received
    routing in the checkpointed call's recompute memo (`core.recompute`, owned by the checkpoint contexts); the
    recomputed dispatch takes them from there, sends the rows in cached mode with that handle (no layout, no
    wait on the host) and registers it under a new entry, which the recomputed combine takes into the
    recompute's graph, freed once the recompute is done. Under a plain `torch.utils.checkpoint` (no memo) the
    recompute dispatches anew. With SAC saving both ops, recompute returns the cached outputs: no
    communication, no new entry, and the forward recorded nothing.
  * several microbatches in flight: one entry and one handle per call, each freed by its own backward.
  * an exception between dispatch and combine (or an early-stopped recompute): the entry is also tied to the
    lifetime of the call's `DeepEPState` by a weakref finalizer, so it is released when the state is dropped
    (when the frames holding it unwind, i.e. once the exception itself is dropped).

Somewhat over 400 lines on purpose: the dispatcher, its two custom ops with their autograd and the two owners of
process-wide state make one handle lifecycle, which a reader should check in one file.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from core import recompute
from core.token_dispatch import Dispatched, TokenDispatcher
from quantization.fp8.quantize import dequantize, quantize
from parallelisms.moe_comm import deepep_cpu
from parallelisms.moe_comm.registry import op_table, register_comm_backend

__all__ = ["BUFFERS", "HANDLES", "BufferManager", "DeepEPDispatcher", "DeepEPState", "DeepEPUnavailableError",
           "HandleRegistry", "deepep_available"]

logger = logging.getLogger(__name__)


class DeepEPUnavailableError(RuntimeError):
    """DeepEP's kernels were asked for but `deep_ep` cannot be imported, or the group's backend has no DeepEP."""


def deepep_available() -> tuple[bool, str]:
    """Whether DeepEP's real kernels can run on this machine (a CUDA device and an importable `deep_ep`), and a
    one-line reason. Without them, only gloo (CPU) runs can use this backend, through the stand-in."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (a CPU run uses the stand-in parallelisms/moe_comm/deepep_cpu.py instead)"
    try:
        import deep_ep
    except (ImportError, OSError) as e:
        return False, (f"deep_ep cannot be imported ({e}); install DeepEP: build it from source with NVSHMEM, "
                       "see docs/deepep.md")
    return True, f"deep_ep {getattr(deep_ep, '__version__', '(version unknown)')}"


#: process-group backends served by the stand-in: gloo (CPU runs) and the dry run's fake group (nothing runs)
_STANDIN_GROUP_BACKENDS = ("gloo", "fake")


def _uses_standin(group) -> bool:
    """NCCL groups use the real kernels, gloo groups the CPU stand-in; any other backend is refused."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return False
    if backend in _STANDIN_GROUP_BACKENDS:
        return True
    raise DeepEPUnavailableError(f"DeepEP needs an NCCL process group (or gloo, for its CPU stand-in), got a "
                                 f"{backend!r} group")


# ----------------------------------------------------------------------------------------------- the buffer

class BufferManager:
    """Owns the one DeepEP `Buffer` of this process's EP group.

    Sized as DeepEP recommends: the max of the dispatch and combine configs' NVL and RDMA size hints for
    `hidden_bytes = hidden * max(element size, 2)` (so bf16 and FP8 share a buffer). Re-created only when the EP
    group changes or the buffer is too small for a larger hidden size. A group is told apart by identity, not only
    by name: torch names groups from 0 again after the default group is destroyed and created anew, and a buffer
    of a destroyed group must not serve its namesake.
    """

    def __init__(self) -> None:
        self._buffer = None
        self._group = None  # the group the buffer was built over
        self._nbytes = 0
        self._sized_for: int | None = None  # the hidden bytes of the last request that needed no change (fast path)
        self._logged_standin = False

    def get(self, group, hidden_bytes: int, lazy: bool = False):
        """The buffer for `group`, created or grown if needed (a collective over the group when it is).

        Creation runs outside every dispatch mode: buffer construction communicates and copies to the host, and
        a selective-checkpoint mode would otherwise cache those ops and desynchronise recompute (torchtitan
        #2505). `lazy=True` marks a creation from inside a forward, which `DeepEPDispatcher.prepare` avoids.
        """
        if group is self._group and self._sized_for == hidden_bytes:
            return self._buffer
        buffer_cls = deepep_cpu.Buffer if _uses_standin(group) else _deep_ep_buffer_class()
        nvl, rdma = buffer_size(buffer_cls, hidden_bytes, group.size())
        current = self._buffer
        if (current is not None and group is self._group and current.num_nvl_bytes >= nvl
                and current.num_rdma_bytes >= rdma):
            self._sized_for = hidden_bytes
            return current
        if lazy:
            logger.warning("DeepEP buffer created inside a forward pass; call DeepEPDispatcher.setup() before "
                           "training to create it once, outside activation checkpointing")
        if buffer_cls is deepep_cpu.Buffer and not self._logged_standin:
            logger.info("DeepEP backend on a %s process group: using the CPU stand-in "
                        "parallelisms/moe_comm/deepep_cpu.py (DeepEP's Buffer interface over gloo collectives, "
                        "not DeepEP's kernels)", dist.get_backend(group))
            self._logged_standin = True
        self.close()
        with _disable_current_modes(), torch.no_grad():
            self._buffer = buffer_cls(group, nvl, rdma)
        self._group, self._nbytes, self._sized_for = group, nvl + rdma, hidden_bytes
        return self._buffer

    def lookup(self, group_key: str):
        """The buffer of the group named `group_key` (it must exist: dispatch creates it before the op runs)."""
        current = None if self._group is None else self._group.group_name
        if self._buffer is None or current != group_key:
            raise RuntimeError(f"no DeepEP buffer for process group {group_key!r} (current: {current!r})")
        return self._buffer

    def nbytes(self) -> int:
        """Bytes the buffer holds (NVL + RDMA); DeepEP allocates them outside PyTorch's caching allocator."""
        return self._nbytes

    def close(self) -> None:
        """Drop the buffer (destroying it first when it was built with `explicitly_destroy=True`)."""
        if self._buffer is not None and getattr(self._buffer, "explicitly_destroy", False):
            self._buffer.destroy()
        self._buffer, self._group, self._nbytes, self._sized_for = None, None, 0, None


def buffer_size(buffer_cls, hidden_bytes: int, n: int) -> tuple[int, int]:
    """(NVL bytes, RDMA bytes) DeepEP recommends for `n` ranks: the max of its dispatch and combine configs'
    size hints."""
    nvl, rdma = 0, 0
    for config in (buffer_cls.get_dispatch_config(n), buffer_cls.get_combine_config(n)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, n))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, n))
    return nvl, rdma


#: RDMA bytes planned for an internode group when deep_ep is not installed to ask (DeepEP's own tests use 1e9)
PLANNED_RDMA_BYTES = 10 ** 9


def _deep_ep_buffer_class():
    ok, why = deepep_available()
    if not ok:
        raise DeepEPUnavailableError(why)
    import deep_ep

    return deep_ep.Buffer


# ----------------------------------------------------------------------------------------------- the handles

class _Handle:
    """A DeepEP handle (its tuple of tensors) and the group whose buffer made it."""

    __slots__ = ("tensors", "group_key", "__weakref__")

    def __init__(self, tensors: tuple, group_key: str):
        self.tensors = tensors
        self.group_key = group_key


class HandleRegistry:
    """The one owner of DeepEP handles between a dispatch and its combine.

    `add` registers a dispatch's handle under a new id; `take` hands it to combine's autograd node; `release`
    drops it when nothing will run backward. `live_handles()` counts handles alive anywhere (here or held by
    autograd nodes waiting for backward): 0 at the end of every step.
    """

    def __init__(self) -> None:
        self._pending: dict[int, _Handle] = {}
        self._ids = itertools.count()
        self._alive: weakref.WeakSet[_Handle] = weakref.WeakSet()

    def add(self, tensors: tuple, group_key: str) -> int:
        """Register a new handle; returns its id."""
        handle = _Handle(tensors, group_key)
        handle_id = next(self._ids)
        self._pending[handle_id] = handle
        self._alive.add(handle)
        return handle_id

    def get(self, handle_id: int) -> _Handle | None:
        """The handle, if still registered."""
        return self._pending.get(handle_id)

    def take(self, handle_id: int) -> _Handle | None:
        """Remove the handle from the registry and return it to the caller, who now owns it."""
        return self._pop(handle_id)

    def release(self, handle_id: int) -> None:
        """Forget the handle (idempotent)."""
        self._pop(handle_id)

    def release_when_dropped(self, owner: object, handle_id: int) -> None:
        """Release `handle_id` when `owner` is garbage (the safety net for paths that skip combine)."""
        weakref.finalize(owner, self.release, handle_id).atexit = False

    def _pop(self, handle_id: int) -> _Handle | None:
        return self._pending.pop(handle_id, None)

    def pending(self) -> int:
        """Handles registered and not yet combined."""
        return len(self._pending)

    def live_handles(self) -> int:
        """Handles alive anywhere: registered, or owned by an autograd node whose backward has not run."""
        return len(self._alive)


BUFFERS = BufferManager()
HANDLES = HandleRegistry()


# ----------------------------------------------------------------------------------------------- the custom ops

@torch.library.custom_op("deepep::dispatch", mutates_args=())
def _dispatch_op(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int, group_key: str,
                 fp8_block: int, fp8_source: torch.dtype
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """Layout + DeepEP dispatch. Returns (recv_x, recv_topk_idx (local ids, -1 elsewhere), recv_topk_weights,
    received tokens per local expert (CPU int64), handle id (CPU int64 scalar), the handle's tensors).

    With `fp8_block` > 0, x rounded to `fp8_source` (the dtype the experts quantise from) travels as (e4m3 rows,
    fp32 scales per 1 x fp8_block tile) and recv_x comes back dequantised, in x's dtype; gradients pass straight
    through (the experts quantise the same tiles themselves).

    The handle's tensors are returned only so that whoever watches ops (the exact memory tracker) sees memory
    this op allocates and something keeps alive; the caller drops them and keeps the id.
    """
    buffer = BUFFERS.lookup(group_key)
    wire_x = quantize(x.to(fp8_source), 1, fp8_block) if fp8_block else x
    key = ("deepep.dispatch", group_key, tuple(x.shape), tuple(topk_idx.shape))
    forward = recompute.replay(key)
    if forward is not None:
        # an activation-checkpoint recompute of a dispatch: its forward's layout, and only the rows travel again
        # (DeepEP's cached mode: no layout kernel, no notify, no wait on the host for the received counts)
        handle, recv_idx, recv_w, counts = forward
        recv_x = buffer.dispatch(wire_x, handle=handle)[0]
        recv_idx, recv_w = recv_idx.detach(), recv_w.detach()
    else:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            wire_x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
        handle = tuple(handle)
        # kept for the recompute while the graph lives, if checkpointing will run this op again: the handle (which
        # the forward's autograd nodes hold anyway) and the received routing, M x K ids and weights (12 bytes a slot)
        recompute.record(key, (handle, recv_idx.detach(), recv_w.detach(), counts))
    if fp8_block:
        recv_x = dequantize(*recv_x, 1, fp8_block, x.dtype)
    handle_id = HANDLES.add(handle, group_key)
    return (recv_x, recv_idx, recv_w, torch.tensor(counts, dtype=torch.int64),
            torch.tensor(handle_id, dtype=torch.int64), [t for t in handle if isinstance(t, Tensor)])


@torch.library.custom_op("deepep::combine", mutates_args=())
def _combine_op(x: Tensor, handle_id: Tensor, will_backward: bool) -> Tensor:
    """DeepEP combine of received rows `x` with the handle `handle_id`; releases the handle if no backward
    will need it (`will_backward` is decided by the caller, where grad mode is still visible)."""
    hid = int(handle_id)
    handle = HANDLES.get(hid)
    if handle is None:
        raise RuntimeError(f"DeepEP handle {hid} is gone: was deepep_combine recomputed while deepep_dispatch was "
                           "saved? Save both or neither in activation_checkpoint.save_ops")
    combined, _, _ = BUFFERS.lookup(handle.group_key).combine(x, handle.tensors)
    if not will_backward:
        HANDLES.release(hid)
    return combined


def _consume(ctx) -> _Handle:
    handle, ctx.handle = ctx.handle, None
    if handle is None:
        raise RuntimeError("DeepEP handle already used: backward through a DeepEP dispatch/combine runs once "
                           "(retain_graph=True with a second backward is not supported)")
    return handle


def _dispatch_setup_context(ctx, inputs, output) -> None:
    # The handle object itself goes into the node, not the id: the registry entry is gone after combine. In a
    # SAC recompute that returns cached outputs the entry is already gone and the node (discarded) gets None.
    ctx.handle = HANDLES.get(int(output[4]))


def _dispatch_backward(ctx, grad_recv_x, grad_recv_idx, grad_recv_w, grad_counts, grad_id, grad_handle):
    handle = _consume(ctx)
    grad_w = grad_recv_w.contiguous() if ctx.needs_input_grad[2] else None
    grad_x, grad_topk_w, _ = BUFFERS.lookup(handle.group_key).combine(
        grad_recv_x.contiguous(), handle.tensors, topk_weights=grad_w)
    return grad_x, None, grad_topk_w, None, None, None, None


def _combine_setup_context(ctx, inputs, output) -> None:
    ctx.handle = HANDLES.take(int(inputs[1]))


def _combine_backward(ctx, grad_out):
    handle = _consume(ctx)
    grad_x, _, _, _, _, _ = BUFFERS.lookup(handle.group_key).dispatch(grad_out.contiguous(), handle=handle.tensors)
    return grad_x, None, None


torch.library.register_autograd("deepep::dispatch", _dispatch_backward, setup_context=_dispatch_setup_context)
torch.library.register_autograd("deepep::combine", _combine_backward, setup_context=_combine_setup_context)


# ----------------------------------------------------------------------------------------------- the dispatcher

@dataclass(eq=False)
class DeepEPState:
    """What a combine needs from its dispatch.

    handle_id: CPU int64 scalar, the key of the handle in `HANDLES`.
    slot_row_MK: for each received token and top-k slot, its row in the expert layout, or num_rows (a zero row)
        when the slot's expert lives on another rank.
    num_rows: rows of the expert layout (N).
    wire_dtype: dtype of the rows on the wire.
    """

    handle_id: Tensor
    slot_row_MK: Tensor
    num_rows: int
    wire_dtype: torch.dtype


@register_comm_backend("deepep")
class DeepEPDispatcher(TokenDispatcher):
    """TokenDispatcher over DeepEP's normal kernels; experts split evenly and contiguously over the EP group.

    Wire dtype: bf16 with the real kernels (DeepEP's requirement), outputs cast back to the caller's dtype. The CPU
    stand-in also carries fp32 unchanged, so an fp32 model gives the all-to-all backend's numbers.
    """

    ac_ops = {"deepep_dispatch": ("deepep.dispatch.default",), "deepep_combine": ("deepep.combine.default",)}
    uses_all_to_all = False
    recompute_reuses_routing = True

    @classmethod
    def metrics(cls) -> dict[str, float]:
        """Live handles (0 at every step end) and the bytes of the DeepEP buffer (allocated outside PyTorch)."""
        return {"moe/live_handles": float(HANDLES.live_handles()),
                "memory/deepep_buffer_GiB": BUFFERS.nbytes() / 2**30}

    #: DeepEP reports ~150 of 160 GB/s NVLink and ~45 of 50 GB/s RDMA for its normal kernels
    exchange_efficiency = 0.9

    @classmethod
    def planned_buffer_bytes(cls, hidden_bytes: int, ep: int) -> int:
        """The buffer `BufferManager` would create: deep_ep's own size hints where it is installed; else the
        stand-in's (which follow DeepEP's NVL formula) for the node's ranks, plus `PLANNED_RDMA_BYTES` when the group
        spans nodes (more than 8 ranks)."""
        if deepep_available()[0]:
            return sum(buffer_size(_deep_ep_buffer_class(), hidden_bytes, ep))
        local = min(ep, deepep_cpu._MAX_NVL_PEERS)
        # the stand-in knows groups of 2, 4 and 8; other sizes are planned as the node's 8 (an upper bound)
        nvl, _ = buffer_size(deepep_cpu.Buffer, hidden_bytes, local if local in (2, 4, 8) else 8)
        return nvl + (PLANNED_RDMA_BYTES if ep > local else 0)

    @classmethod
    def config_problem(cls, parallel_dims, activation_checkpoint, compile) -> tuple[str, str, str] | None:
        """DeepEP needs EP > 1, an importable deep_ep on a CUDA machine, both of its ops saved or neither, no
        compiled model."""
        key = "parallelism.expert_parallel_comm_backend"
        if not parallel_dims.ep_enabled:
            return key, "deepep needs parallelism.expert_parallel_degree > 1", "alltoall with EP = 1"
        # the trainer runs on CUDA + NCCL whenever CUDA is visible (trainer/device.py), and on gloo otherwise
        if torch.cuda.is_available():
            ok, why = deepep_available()
            if not ok:
                return key, f"deepep on a CUDA machine: {why}", "alltoall, or deepep once deep_ep is installed"
        ac = activation_checkpoint
        saved = op_table().save_ops(ac.save_ops)
        if ac.mode == "selective" and ("deepep_dispatch" in saved) != ("deepep_combine" in saved):
            return ("activation_checkpoint.save_ops", "saves only one of deepep_dispatch / deepep_combine; a "
                    "recomputed dispatch needs its combine recomputed too", "both or neither")
        if compile.enable and "model" in compile.components:
            return ("compile.components", "the DeepEP custom ops cannot be traced by torch.compile yet",
                    "[\"loss\"] with deepep, or expert_parallel_comm_backend = alltoall")
        return None

    def __init__(self, group, num_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.ep} EP ranks")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep
        self.group_key = group.group_name
        self._standin = _uses_standin(group)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype the token rows travel in for a model computing in `dtype`."""
        if self._standin and dtype in (torch.float32, torch.bfloat16):
            return dtype
        return torch.bfloat16

    dequantizes_in_op = True  # `deepep::dispatch` returns the rows dequantised

    @classmethod
    def can_quantize_wire(cls, block: int) -> bool:
        """FP8 dispatch with one scale per 1 x `block` tile: DeepEP's kernels take 1 x 128 tiles only."""
        return block == deepep_cpu.FP8_BLOCK

    def setup(self, hidden_dim: int, dtype: torch.dtype) -> None:
        """Create the DeepEP buffer of the EP group now (collective over the group), sized for rows of `hidden_dim`
        in this dtype's wire dtype; a no-op when the buffer already fits."""
        wire = self.wire_dtype(dtype)
        BUFFERS.get(self.group, hidden_dim * max(wire.itemsize, 2))

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK, num_tokens_per_expert):
        # num_tokens_per_expert is not needed: DeepEP's layout kernel counts on the device itself
        wire = self.wire_dtype(x_TD.dtype)
        BUFFERS.get(self.group, x_TD.shape[1] * max(wire.itemsize, 2), lazy=True)
        # FP8 rows are quantised from the dtype the experts quantise from, in the op
        x_in = x_TD if self.fp8_block else x_TD.to(wire)
        recv_x_MD, recv_idx_MK, recv_w_MK, counts_E, handle_id, _ = torch.ops.deepep.dispatch(
            x_in.contiguous(), topk_idx_TK.contiguous(), topk_weights_TK.float().contiguous(),
            self.num_experts, self.group_key, self.fp8_block, self.fp8_source_dtype(x_TD))
        M, K = recv_idx_MK.shape
        N = sum(counts_E.tolist())  # a CPU tensor: DeepEP already synced the counts to the host
        # group the (token, slot) pairs by local expert; slots of other ranks (-1) sort last and are cut off
        sort_key = torch.where(recv_idx_MK >= 0, recv_idx_MK, self.num_local_experts).reshape(-1)
        order = torch.argsort(sort_key, stable=True)
        rows_N = order[:N]
        slot_row_MK = torch.argsort(order).clamp_(max=N).view(M, K)  # inverse permutation, cut-offs -> row N
        x_ND = recv_x_MD.to(x_TD.dtype)[rows_N // K]
        weights_N = recv_w_MK.reshape(-1)[rows_N]
        state = DeepEPState(handle_id, slot_row_MK, N, wire)
        HANDLES.release_when_dropped(state, int(handle_id))
        return Dispatched(x_ND, weights_N, counts_E.to(x_TD.device, non_blocking=True), state)

    def combine(self, y_ND, state: DeepEPState):
        if y_ND.shape[0] != state.num_rows:
            raise ValueError(f"combine got {y_ND.shape[0]} rows, dispatch produced {state.num_rows}")
        # row N is the zero row for slots handled on other ranks; the sum per received token keeps slot order
        y_ext = torch.cat([y_ND, y_ND.new_zeros(1, y_ND.shape[1])])
        y_MD = y_ext[state.slot_row_MK].sum(dim=1)
        will_backward = torch.is_grad_enabled() and y_MD.requires_grad
        out_TD = torch.ops.deepep.combine(y_MD.to(state.wire_dtype).contiguous(), state.handle_id, will_backward)
        return out_TD.to(y_ND.dtype)
