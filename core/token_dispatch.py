"""The token dispatcher interface between the MoE layer and its communication backend.

It lives below the models and the parallelisms so that a model's MoE calls it without importing the
parallelisms, while the comm backends (`parallelisms/moe_comm/`) subclass it. `MoE.forward` calls `dispatch` after
routing and `combine` after the experts; what happens in between (nothing, or an exchange over the EP group) is the backend's business.
The per-call state is returned by `dispatch` and handed back to `combine` explicitly: a backend never keeps it on
`self`, so an activation-checkpoint recompute or a second pipeline microbatch cannot overwrite the state of another
call.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

#: the dtype e4m3 token rows travel in through torch.distributed's all-to-all (FP8 dispatch): gloo has no float8
#: type. Activation checkpointing tells them from the integer split sizes by it (`_routing_metadata_policy`).
FP8_WIRE_DTYPE = torch.uint8


class Dispatched(NamedTuple):
    """What the experts of this rank receive.

    x_ND: token rows grouped by local expert (expert 0's rows first); may hold padding rows past sum(counts)
      if the backend's `padded_rows` says so.
    weights_N: the routing weight of each row (fp32); the MoE multiplies expert outputs by it before `combine`.
    counts_E: rows per local expert (int tensor on the device; no host sync needed to read offsets).
    state: opaque, owned by this call; pass it to `combine` once.
    """

    x_ND: torch.Tensor
    weights_N: torch.Tensor
    counts_E: torch.Tensor
    state: Any


class TokenDispatcher:
    """Base class of the communication backends. Stateless between calls.

    An expert-parallel backend registers itself by name (`parallelisms.moe_comm.registry`) and is built as
    `cls(group, num_experts)` for every MoE layer, with `group` the EP process group. Besides `dispatch` and
    `combine` it may override the lifecycle hooks below (defaults: nothing to do): `setup` (process-wide state
    such as comm buffers, before the first forward), `ac_ops` (its ops, for selective activation checkpointing),
    `quantize_wire` (FP8 rows on the wire), `metrics` (scalars the trainer logs every step) and `config_problem`
    (config checks before launch).
    """

    #: number of experts that live on this rank (set by the backend from the EP degree)
    num_local_experts: int
    #: whether torch.compile may trace dispatch and combine into the block's graph: only device work, no host
    #: syncs (split sizes read with `.tolist()`) and no collectives. False (the safe default for a new backend)
    #: keeps them eager between compiled pieces of the block (see parallelisms/compile.py).
    traceable: bool = False
    #: whether `dispatch` may return rows past sum(counts_E) (padding); the experts then mask those rows, which
    #: costs a pass over the rows in forward and in backward. True is the safe default for a new backend.
    padded_rows: bool = True
    #: Ops this backend dispatches that selective activation checkpointing may save, as op-table names (usable in
    #: `activation_checkpoint.save_ops`) -> qualified op names (`namespace.op.overload`). They communicate, so a
    #: listed one stays saved inside recomputed modules too. They are in the default save_ops.
    ac_ops: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: whether tokens travel through torch.distributed's all_to_all (the op table's "all_to_all"); a backend with
    #: kernels of its own sets False, so that a save_ops naming all_to_all is reported as saving nothing.
    uses_all_to_all: ClassVar[bool] = True
    #: ranks the routed experts are split over (a backend sets it from its group; 1: every expert is local)
    ep: int = 1
    #: whether a recompute of `dispatch` (activation checkpointing) reuses what its forward received (the top-k ids
    #: and weights of each received token) instead of exchanging the layout again (`core.recompute`): the memory
    #: plan then counts them as kept from the forward to the recompute
    recompute_reuses_routing: ClassVar[bool] = False
    #: fraction of the link bandwidth this backend's token exchange reaches, for the layout planner's step-time
    #: model (`trainer.tools.step_time`; `--hw.exchange_efficiency` overrides it)
    exchange_efficiency: ClassVar[float] = 0.5

    def setup(self, hidden_dim: int, dtype: torch.dtype) -> None:
        """Create process-wide state (comm buffers) for tokens of `hidden_dim` computed in `dtype`.

        Called for every MoE layer's dispatcher after expert parallelism is applied, before the first forward and
        outside any activation-checkpointed region (ops run there would enter the SAC cache); must be cheap when
        the state already fits. Collective over the EP group when it creates something.
        """

    #: > 0 once `quantize_wire` accepted: the dispatched rows travel as e4m3 with a scale per 1 x fp8_block tile
    fp8_block: int = 0
    #: the dtype the experts cast their inputs to before they quantise them, where the model's plan knows it (bf16
    #: for experts compiled or on CUDA); None: autocast's where autocast is on, else the rows' own (`fp8_source_dtype`)
    fp8_experts_dtype: torch.dtype | None = None
    #: whether the exchange op that receives FP8 rows (one in `ac_ops`) also dequantises them, so that selective
    #: activation checkpointing saves them in the compute dtype; False: it saves what came over the wire
    dequantizes_in_op: ClassVar[bool] = False

    @classmethod
    def can_quantize_wire(cls, block: int) -> bool:
        """Whether this backend can send the dispatched rows as e4m3 with one fp32 scale per 1 x `block` tile (the
        layout planner asks too, to count the bytes). Default: it cannot, and sends the compute dtype."""
        return False

    def quantize_wire(self, block: int, experts_dtype: torch.dtype | None = None) -> bool:
        """Send the dispatched rows as e4m3 with one fp32 scale per 1 x `block` tile, if this backend can
        (`can_quantize_wire`); returns whether it will. `dispatch` still returns the rows in their own dtype
        (dequantised on arrival), and the gradients travel back in it.

        Called by a model's plan when the routed experts quantise their inputs in the same 1 x `block` tiles
        (the blockwise FP8 recipe), from `experts_dtype` where the plan knows it (`fp8_experts_dtype`): the
        experts then see the same values, and only the bytes on the wire change.
        """
        if not self.can_quantize_wire(block):
            return False
        self.fp8_block, self.fp8_experts_dtype = block, experts_dtype
        return True

    def fp8_source_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype FP8 dispatch rounds rows `x` to before quantising them: the one the experts quantise from (an
        fp32 row rounded to bf16 first may quantise to other e4m3 values than the fp32 row itself)."""
        if self.fp8_experts_dtype is not None:
            return self.fp8_experts_dtype
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    @classmethod
    def metrics(cls) -> dict[str, float]:
        """Scalars the trainer logs at the end of every step (measured now, process-wide)."""
        return {}

    @classmethod
    def planned_buffer_bytes(cls, hidden_bytes: int, ep: int) -> int:
        """Bytes of communication buffers this backend holds for the whole run, outside PyTorch's allocator, on
        each rank of an EP group of `ep` ranks sending rows of `hidden_bytes` (the layout planner adds them to a
        rank's peak). Default: none."""
        return 0

    @classmethod
    def config_problem(cls, parallel_dims, activation_checkpoint, compile) -> tuple[str, str, str] | None:
        """The first reason this backend cannot run the job, as (config key, problem, allowed values), or None.

        Runs in preflight and in every rank before any process-group work: check what needs neither the model nor
        a process group, from the resolved degrees (`parallel_dims`) and the `[activation_checkpoint]` and
        `[compile]` sections (the settings that decide how the backend's ops are recomputed and traced).
        """
        return None

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor) -> Dispatched:
        """Send each (token, expert) pair to the rank that owns the expert, grouped by local expert."""
        raise NotImplementedError

    def combine(self, y_ND: torch.Tensor, state: Any) -> torch.Tensor:
        """Return the weighted expert outputs to their tokens and sum over the top-k: [T, D]."""
        raise NotImplementedError


def host_list(t: torch.Tensor) -> list:
    """`t` as a Python list through an explicit copy to host memory: the one way a dispatcher syncs with the host.

    On an accelerator `.tolist()` alone would copy too; the explicit `_to_copy` makes the sync one visible op on
    every device, CPU included, so activation checkpointing can save it ("d2h_copy": a recompute reads the saved
    host copy and never syncs again) and tests can count syncs on CPU.
    """
    return t.to("cpu", copy=True).tolist()


class LocalState(NamedTuple):
    """How to undo a local dispatch: row n of the grouped layout came from token token_N[n]."""

    token_N: torch.Tensor
    num_tokens: int


class LocalTokenDispatcher(TokenDispatcher):
    """No communication (EP = 1): sort the (token, expert) pairs by expert and back.

    Everything stays on the device: a stable argsort groups rows, counts come from the router as a tensor.
    Shapes depend only on the token count (always T*K rows, no padding), so a compiled block never recompiles for
    routing. Rows go out with `index_select` and come back with `index_add_`, each the other's backward: both
    directions are one pass over the rows, with no inverse permutation (plain indexing, `x[idx]`, would run
    `index_put_` with accumulation in backward, several times slower on CPU). Under torch.compile, deterministic
    mode keeps `index_add_` on the eager kernel, which adds in row order.
    """

    traceable = True
    padded_rows = False

    def __init__(self, num_experts: int):
        self.num_local_experts = num_experts

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK, num_tokens_per_expert):
        T, K = topk_idx_TK.shape
        order_N = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
        token_N = order_N // K
        x_ND = x_TD.index_select(0, token_N)
        weights_N = topk_weights_TK.reshape(-1).index_select(0, order_N)
        return Dispatched(x_ND, weights_N, num_tokens_per_expert, LocalState(token_N, T))

    def combine(self, y_ND, state: LocalState):
        # each token's top-k rows summed in expert order; in place on a fresh tensor (out of place would copy it)
        return y_ND.new_zeros(state.num_tokens, y_ND.shape[1]).index_add_(0, state.token_N, y_ND)


class ExpertParallelLayer(Protocol):
    """What expert parallelism needs of an MoE layer (`parallelisms.expert_parallel.apply_expert_parallel`): its
    routed experts, whose direct parameters all have the expert dimension first (split over the EP ranks), and the
    dispatcher its forward calls (replaced by the configured comm backend's)."""

    experts: nn.Module
    dispatcher: TokenDispatcher

