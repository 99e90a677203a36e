"""DeepSeek-V3 mixture of experts: router, grouped experts, shared experts, load balancing.

Path of the tokens through `MoE.forward`:
    router (fp32 scores, bias-corrected top-k) -> dispatcher.dispatch (local sort, or EP communication)
    -> grouped experts (one `torch._grouped_mm` per projection) -> multiply by routing weight
    -> dispatcher.combine (back to token order, sum over top-k) -> + shared experts
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from core.quantization import QuantizedGroupedMM
from core.recompute import in_recompute
from core.token_dispatch import LocalTokenDispatcher, TokenDispatcher

from .args import ModelArgs


class FeedForward(nn.Module):
    """SwiGLU FFN: w2(silu(w1 x) * w3 x). Used by dense layers and as the shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Fp32Linear(nn.Linear):
    """A Linear that always computes in fp32 (the router's scores decide routing; bf16 ties flip experts).

    A module, not a bare F.linear, so activation checkpointing can address it by name (`moe.router.gate`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # autocast would run the linear in bf16 whatever the dtype of its inputs
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class Router(nn.Module):
    """Token-choice top-k router, DeepSeek-V3 style.

    Scores are computed in fp32 (sigmoid for V3, softmax for V2). `expert_bias` shifts scores for *selection only*;
    the weights are gathered from the unbiased scores. Group-limited routing keeps the `n_limited_groups` best
    groups (group score = sum of its top-2 scores, or max for V2) and masks the rest at -inf before the top-k.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Fp32Linear(args.dim, args.n_routed_experts, bias=False)
        self.num_experts = args.n_routed_experts
        self.top_k = args.n_activated_experts
        self.score_func = args.score_func
        self.n_groups = args.n_expert_groups
        self.n_limited_groups = args.n_limited_groups
        self.group_score_func = args.group_score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale

    def forward(self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (topk_weights_TK fp32, topk_idx_TK int64, scores_TE fp32)."""
        logits_TE = self.gate(x_TD)
        scores_TE = logits_TE.sigmoid() if self.score_func == "sigmoid" else logits_TE.softmax(dim=-1)
        choice_TE = scores_TE.detach()
        if expert_bias_E is not None:
            choice_TE = choice_TE + expert_bias_E
        if self.n_groups > 1:
            T = x_TD.shape[0]
            choice_TGe = choice_TE.view(T, self.n_groups, -1)
            if self.group_score_func == "top2_sum":
                group_scores_TG = choice_TGe.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores_TG = choice_TGe.amax(dim=-1)
            kept_groups = group_scores_TG.topk(self.n_limited_groups, dim=-1).indices
            dropped_TG = torch.ones_like(group_scores_TG, dtype=torch.bool).scatter(1, kept_groups, False)
            choice_TE = choice_TGe.masked_fill(dropped_TG.unsqueeze(-1), float("-inf")).view(T, -1)
        topk_idx_TK = choice_TE.topk(self.top_k, dim=-1).indices
        topk_weights_TK = scores_TE.gather(1, topk_idx_TK)
        if self.route_norm:
            topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_weights_TK * self.route_scale, topk_idx_TK, scores_TE


def _local(t: torch.Tensor) -> torch.Tensor:
    """Expert weights may be DTensors (sharded over EP); token counts vary per step, so compute on local shards."""
    # isinstance, not hasattr(t, "to_local"): traced by torch.compile, the hasattr test missed the DTensor's
    # method and the sharded weights reached `_grouped_mm` as DTensors
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """The routed experts as stacked weights: w1, w3 [E, hidden, dim] and w2 [E, dim, hidden].

    `use_grouped_mm` runs one `torch._grouped_mm` per projection over all experts (no host sync: offsets are a
    device tensor); otherwise a per-expert loop, the reference oracle, which reads the counts on the host.
    `quantized_mm` (None, or a lower-precision grouped GEMM set by a conversion such as FP8's, see
    `core.quantization`) replaces the grouped GEMMs.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.quantized_mm: QuantizedGroupedMM | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """x_ND rows grouped by expert, counts_E rows each. With `padded`, x_ND may hold rows past sum(counts)
        (padding): they come back as zeros, with zero gradient; without, it must hold exactly sum(counts) rows.

        The output is in the dtype the experts computed in: x's, or bf16 under autocast, torch.compile or CUDA.
        """
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.use_grouped_mm:
            return _experts_grouped_mm(x_ND, w1, w2, w3, counts_E, padded, self.quantized_mm)
        return _experts_loop(x_ND, w1, w2, w3, counts_E)


# oneDNN builds (JIT-compiles) a bf16/fp16 CPU GEMM kernel for every new row count, then caches it
# (the cost is in docs/performance.md, "MoE layer vs the FLOPs-equivalent dense FFN");
# routing changes every expert's row count at every step, so there the groups are padded with zero rows to a
# multiple of this: the row counts take few distinct values and hit the cache. fp32 GEMMs have no such cost.
CPU_GROUP_ALIGN = 32


def _experts_grouped_mm(x_ND, w1, w2, w3, counts_E, padded=True, quantized_mm=None):
    """The SwiGLU experts with one `torch._grouped_mm` per projection; no host sync (offsets stay on the device).

    With a `quantized_mm` (FP8), each expert's rows are padded to a multiple of its `row_align` (FP8: 128, the
    token tiles of the weight gradients' quantisation must not straddle two experts) and it runs the GEMMs.

    Returns the compute dtype (no cast back to x's: the MoE's multiply by the fp32 routing weights promotes).
    """
    offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)  # _grouped_mm wants int32 offsets
    x = x_ND
    if padded:
        # Rows past the last offset are uninitialised memory in _grouped_mm's output and input-grad on CPU: zero
        # the inputs there (so their gradient is exactly 0) and the outputs (so garbage never reaches a combine).
        valid_N1 = (torch.arange(x.shape[0], device=x.device) < offsets_E[-1]).unsqueeze(-1)
        x = torch.where(valid_N1, x, 0)
    # The CUDA kernel is bf16-only, and so is the shape function torch.compile traces with on every device (eager
    # CPU also runs fp32): under compile an fp32 model computes its experts in bf16 (see docs/compile.md).
    # `_grouped_mm` has no autocast rule: under autocast, take autocast's dtype as its other matmuls do.
    if x.is_cuda or torch.compiler.is_compiling():
        compute_dtype = torch.bfloat16
    elif torch.is_autocast_enabled(x.device.type):
        compute_dtype = torch.get_autocast_dtype(x.device.type)
    else:
        compute_dtype = x.dtype
    x = x.to(compute_dtype)
    if quantized_mm is not None:
        out = _swiglu_quantized(x, w1, w2, w3, counts_E, quantized_mm)
        return torch.where(valid_N1, out, 0) if padded else out
    w1, w2, w3 = (w.to(compute_dtype).transpose(-2, -1) for w in (w1, w2, w3))
    if x.device.type == "cpu" and compute_dtype in (torch.bfloat16, torch.float16):
        out = _swiglu_row_aligned(x, w1, w2, w3, counts_E, CPU_GROUP_ALIGN)
    else:
        out = _swiglu_grouped(x, w1, w2, w3, offsets_E)
    return torch.where(valid_N1, out, 0) if padded else out


def _swiglu_grouped(x, w1, w2, w3, offsets_E):
    h = F.silu(torch._grouped_mm(x, w1, offs=offsets_E)) * torch._grouped_mm(x, w3, offs=offsets_E)
    return torch._grouped_mm(h, w2, offs=offsets_E)


def _swiglu_row_aligned(x, w1, w2, w3, counts_E, align: int):
    """`_swiglu_grouped` with each expert's rows padded with zero rows to a multiple of `align`."""
    x_P, dest_N, offsets_E = _align_rows(x, counts_E, align)
    return gather_rows(_swiglu_grouped(x_P, w1, w2, w3, offsets_E), dest_N)


def _swiglu_quantized(x, w1, w2, w3, counts_E, mm: QuantizedGroupedMM):
    """The SwiGLU experts on a lower-precision grouped GEMM (weights as stored: [E, out, in])."""
    x_P, dest_N, offsets_E = _align_rows(x, counts_E, mm.row_align)
    host_E = mm.host_offsets(x_P, w1, offsets_E)  # one host copy for the three projections, where one is read
    h = F.silu(mm(x_P, w1, offsets_E, host_E)) * mm(x_P, w3, offsets_E, host_E)
    return gather_rows(mm(h, w2, offsets_E, host_E), dest_N)


class _GatherRows(torch.autograd.Function):
    """`t_P.index_select(0, rows_N)` for rows that never repeat, whose backward copies each gradient row into its
    row (`index_copy_`) where index_select's adds it (`index_add_`, atomics in case rows repeat). Inductor does not
    generate a bf16 index_add (its decomposition declines bf16, pytorch/pytorch#137425): ATen's eager kernel ran it,
    7.4-8.0 ms of the FP8 steps at the 671B shapes on an H200 (2026-11-27, `indexFuncLargeIndex ... ReduceAdd`). A
    copy is a plain store, which inductor generates and fuses."""

    @staticmethod
    def forward(ctx, t_P: torch.Tensor, rows_N: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows_N)
        ctx.num_rows = t_P.shape[0]
        return t_P.index_select(0, rows_N)

    @staticmethod
    def backward(ctx, grad_N: torch.Tensor):
        (rows_N,) = ctx.saved_tensors
        return grad_N.new_zeros(ctx.num_rows, *grad_N.shape[1:]).index_copy_(0, rows_N, grad_N), None


def gather_rows(t_P: torch.Tensor, rows_N: torch.Tensor) -> torch.Tensor:
    """Rows `rows_N` of t_P (indices that never repeat: `_align_rows`' destinations); rows of t_P not gathered get
    a zero gradient."""
    return _GatherRows.apply(t_P, rows_N)


def padded_rows(num_rows: int, num_experts: int, align: int) -> int:
    """Rows of the layout `_align_rows` makes for num_rows rows over num_experts groups padded to `align`."""
    return -(-(num_rows + num_experts * (align - 1)) // align) * align


def _align_rows(x, counts_E, align: int):
    """x's rows (grouped by expert, counts_E each) with every group padded with zero rows to a multiple of
    `align`: returns (x_P, dest_N: the padded row of each row of x, int32 end offsets of the padded groups).

    The padded layout has a fixed size (every group gains at most align - 1 rows, and the total is rounded up to a
    multiple of align), so shapes never depend on the routing, and the transposed layouts of the weight gradients
    have row strides that are multiples of 16 bytes, as `_grouped_mm` requires (under EP a rank's row count is
    anything). Rows go in with `index_copy_` and come out with `gather_rows`, whose backward passes only read and
    write the rows of the groups: the uninitialised rows `_grouped_mm` leaves past the last group are never read.
    """
    N, E = x.shape[0], counts_E.shape[0]
    ends_E = torch.cumsum(counts_E, dim=0)
    padded_counts_E = (counts_E + align - 1) // align * align
    padded_ends_E = torch.cumsum(padded_counts_E, dim=0)
    shift_E = (padded_ends_E - padded_counts_E) - (ends_E - counts_E)  # padded start - start of each group
    rows_N = torch.arange(N, device=x.device)
    # rows past sum(counts) (zeroed padding of the input) ride along with the last expert
    expert_N = torch.bucketize(rows_N, ends_E, right=True).clamp_(max=E - 1)
    dest_N = rows_N + shift_E[expert_N]
    x_P = x.new_zeros(padded_rows(N, E, align), x.shape[1]).index_copy_(0, dest_N, x)
    return x_P, dest_N, padded_ends_E.to(torch.int32)


def _experts_loop(x_ND, w1, w2, w3, counts_E):
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):
        xe = x_ND[start:start + n]
        outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += n
    padding = x_ND.shape[0] - start
    outs.append(x_ND.new_zeros(padding, x_ND.shape[1]))
    return torch.cat(outs)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out` whose backward also feeds d(aux)/d(aux) = grad_scale into the aux-loss graph.

    This adds an auxiliary loss to the training objective without threading it through every module's return
    value (which pipeline stages could not carry). grad_scale is captured at forward time, so later changes to the
    module attribute cannot affect a pending backward (the attribute's setter replaces its tensor, never writes
    into it). grad_scale is a 0-dim tensor so that a compiled block does not specialise on its value.
    """

    @staticmethod
    def forward(ctx, out, aux_loss, grad_scale: torch.Tensor):
        ctx.save_for_backward(grad_scale)
        ctx.aux_dtype = aux_loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (grad_scale,) = ctx.saved_tensors
        return grad_out, grad_scale.to(ctx.aux_dtype), None


def sequence_balance_loss(scores_BSE: torch.Tensor, topk_idx_BSK: torch.Tensor,
                          context_parallel=None) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, summed over the sequences of the batch.

    Per sequence: f_i = E / (K S) * (tokens choosing expert i), P_i = mean over tokens of the normalised score of
    expert i, loss = sum_i f_i P_i (1.0 when perfectly balanced).

    With `context_parallel`, the inputs hold this rank's tokens of each sequence: f counts the whole sequence (a
    sum over the ranks, a constant to autograd) and P sums this rank's tokens only, so the ranks' results add up
    to the loss of the whole sequences, and so do their gradients.
    """
    B, S, E = scores_BSE.shape
    K = topk_idx_BSK.shape[-1]
    chosen_BE = torch.zeros_like(scores_BSE).scatter_(2, topk_idx_BSK, 1.0).sum(dim=1)
    if context_parallel is not None:
        chosen_BE = context_parallel.all_reduce_sum(chosen_BE)
        S = S * context_parallel.degree
    f_BE = chosen_BE * (E / (K * S))
    p_BE = (scores_BSE / scores_BSE.sum(dim=-1, keepdim=True)).sum(dim=1) / S
    return (f_BE * p_BE).sum()


class MoE(nn.Module):
    """Routed experts + shared experts, with auxiliary-loss-free load balancing.

    Buffers:
      expert_bias [E] fp32, persistent (HF `e_score_correction_bias`): added to scores for selection only.
      tokens_per_expert [E] fp32: tokens routed to each expert since the last bias update; counted only in
      training forwards (not under no_grad / eval, and not in activation-checkpoint recompute).
      _aux_grad_scale [] fp64: the value of `aux_loss_grad_scale`.
    """

    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        E = args.n_routed_experts
        self.layer_id = layer_id  # for per-layer routing metrics
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.moe_inter_dim, E, args.use_grouped_mm)
        self.shared_experts = (FeedForward(args.dim, args.moe_inter_dim * args.n_shared_experts)
                               if args.n_shared_experts > 0 else None)
        self.dispatcher: TokenDispatcher = LocalTokenDispatcher(E)
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        self.aux_loss_coeff = 0.0
        self.register_buffer("_aux_grad_scale", torch.ones((), dtype=torch.float64), persistent=False)
        self.context_parallel = None
        """This rank's `ContextParallel` when sequences are split over ranks (set by the parallelize plan): the
        sequence-wise aux loss then counts each sequence's routing over all of its ranks."""

    @property
    def aux_loss_grad_scale(self) -> float:
        """Set each step (the model spec's `before_step`) to 1 / (global valid tokens), the LM loss's normalisation.

        Held in a 0-dim tensor (float64, so the value set is the value read) rather than a Python float: the
        value changes from step to step, and torch.compile would recompile a block for every new float constant.
        """
        return self._aux_grad_scale.item()

    @aux_loss_grad_scale.setter
    def aux_loss_grad_scale(self, value: float) -> None:
        # a new tensor, not an in-place write: a backward still pending from an earlier forward keeps its scale;
        # filled on the device (torch.full), not copied from the host, which would wait for the device on CUDA
        self._aux_grad_scale = torch.full((), value, dtype=torch.float64, device=self._aux_grad_scale.device)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)
        topk_weights_TK, topk_idx_TK, scores_TE = self.router(x_TD, self.expert_bias)
        counts_E = torch.zeros(self.router.num_experts, dtype=torch.int64, device=x_TD.device)
        counts_E = counts_E.scatter_add_(0, topk_idx_TK.reshape(-1), torch.ones_like(topk_idx_TK.reshape(-1)))
        if self.training and torch.is_grad_enabled() and not in_recompute():
            with torch.no_grad():
                # no cast op (the add promotes): selective AC replays saved outputs by their position among the
                # calls of the same op, and an op that runs in forward but not in recompute would shift them
                self.tokens_per_expert.add_(counts_E)

        routed = self.dispatcher.dispatch(x_TD, topk_idx_TK, topk_weights_TK, counts_E)
        y_ND = self.experts(routed.x_ND, routed.counts_E, padded=self.dispatcher.padded_rows)
        # back in x's dtype: under autocast the experts return bf16, and bf16 * fp32 weights computes in fp32
        y_ND = y_ND * routed.weights_N.unsqueeze(-1).to(x_TD.dtype)
        out_TD = self.dispatcher.combine(y_ND, routed.state)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)

        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            # sum form (x the tokens of a whole sequence): divided by the global token count like the LM loss
            cp = self.context_parallel
            seq_len = S * cp.degree if cp is not None else S
            aux = self.aux_loss_coeff * seq_len * sequence_balance_loss(
                scores_TE.view(B, S, -1), topk_idx_TK.view(B, S, -1), cp)
            out_TD = _AttachAuxLoss.apply(out_TD, aux, self._aux_grad_scale)
        return out_TD.view(B, S, D)

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """Zero the expert bias and the token counts, and reset the aux-loss gradient scale to 1 (on `device`, e.g.
        after materialisation from meta)."""
        device = device if device is not None else self.expert_bias.device
        self.expert_bias = torch.zeros_like(self.expert_bias, device=device)
        self.tokens_per_expert = torch.zeros_like(self.tokens_per_expert, device=device)
        self._aux_grad_scale = torch.ones_like(self._aux_grad_scale, device=device)


@torch.no_grad()
def update_expert_bias(moe_layers: list[MoE], coeff: float, group=None) -> torch.Tensor:
    """Auxiliary-loss-free balancing step, once per optimizer step; returns the step's token counts [L, E].

    The counts of all layers are all-reduced in one call over the data-parallel group (every rank routes its own
    tokens to all experts), then each bias moves by coeff * sign(mean - count), centred so the biases do not drift.
    """
    if not moe_layers:
        return torch.zeros(0, 0)
    counts_LE = torch.stack([m.tokens_per_expert for m in moe_layers])
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts_LE, group=group)
    if coeff > 0:
        delta_LE = coeff * torch.sign(counts_LE.mean(dim=-1, keepdim=True) - counts_LE)
        delta_LE = delta_LE - delta_LE.mean(dim=-1, keepdim=True)
        for moe, delta_E in zip(moe_layers, delta_LE):
            moe.expert_bias.add_(delta_E)
    for moe in moe_layers:
        moe.tokens_per_expert.zero_()
    return counts_LE
