"""DeepSeek-V3's side of the memory plan (`trainer/memory_plan.py`): the tensors each block creates in forward,
the backward working sets, the FSDP units and the buffers, from the model args and one microbatch's shape.

Sizes assume balanced routing (every expert rank receives T * top_k rows). See docs/memory.md, "Memory plan".
"""

from __future__ import annotations

from core.quantization import FP8_TILE
from quantization.fp8.accounting import gemm_backward_extra_bytes
from quantization.fp8.config import Fp8Selection, fp8_selection
from core.memory_types import BlockMemory, Item, Shape, StageMemory
from core.model_config import MoESection

from .args import ModelArgs
from .flops import block_gemms
from .moe import CPU_GROUP_ALIGN, padded_rows
from .parallelize import MODULE_DEFAULTS

_I64, _F32 = 8, 4
_FFN_PREFIXES = ("router", "dispatch", "experts", "combine", "ep.", "shared", "feed_forward", "aux")
"""Items of the block's second half (FFN or MoE): freed by its backward before the attention's backward runs."""


def _norm(prefix: str, T: int, width: int, a: int) -> list[Item]:
    # nn.RMSNorm decomposes on CPU: x (kept as the input), rsqrt, x * rsqrt, and the weighted output
    return [Item(f"{prefix}.rsqrt", T * _F32, True, "other"),
            Item(f"{prefix}.normed", T * width * a, True, "mul"),
            Item(f"{prefix}.out", T * width * a, True, "mul")]


def _swiglu(prefix: str, rows: int, dim: int, hidden: int, a: int, mm: str) -> list[Item]:
    return [Item(f"{prefix}.w1", rows * hidden * a, True, mm),
            Item(f"{prefix}.w3", rows * hidden * a, True, mm),
            Item(f"{prefix}.silu", rows * hidden * a, True, "silu"),
            Item(f"{prefix}.prod", rows * hidden * a, True, "mul"),
            Item(f"{prefix}.w2", rows * dim * a, False, mm)]


def sdpa_path(sh: Shape) -> str:
    """The attention kernel's memory behaviour: "math" (CPU fp32: [B, H, S, S] scores and probabilities),
    "flash" (no score matrix) or "flash_padded_v" (CPU bf16: flash with v zero-padded to the q/k head dim,
    `model.attention`)."""
    if sh.device == "cuda":
        return "flash"
    return "flash_padded_v" if sh.act == 2 else "math"


def expert_row_align(sh: Shape, fp8_experts: bool) -> int:
    """The multiple each expert's rows are padded to before the grouped GEMMs (`moe._experts_grouped_mm`): FP8's
    tile (128), oneDNN's kernel-cache granule for bf16 on CPU, or 1 (no padding)."""
    if fp8_experts:
        return FP8_TILE
    return CPU_GROUP_ALIGN if sh.device == "cpu" and sh.act == 2 else 1


def block_items(args: ModelArgs, moe: bool, sh: Shape, aux_loss: bool = False, expert_align: int = 1) -> list[Item]:
    """Every tensor of interest one transformer block creates in forward, for one microbatch; the routed experts'
    rows padded to multiples of `expert_align` (`moe.padded_rows`: a fixed-size layout)."""
    T, a, D, H = sh.T, sh.act, args.dim, args.n_heads
    sdpa = sdpa_path(sh)
    items = [Item("input", T * D * a, True, "input")]
    items += _norm("attention_norm", T, D, a)
    if args.q_lora_rank:
        items.append(Item("wq_a", T * args.q_lora_rank * a, True, "mm"))
        items += _norm("q_norm", T, args.q_lora_rank, a)
        items.append(Item("wq_b", T * H * args.qk_head_dim * a, False, "mm"))
    else:
        items.append(Item("wq", T * H * args.qk_head_dim * a, False, "mm"))
    items.append(Item("wkv_a", T * (args.kv_lora_rank + args.qk_rope_head_dim) * a, True, "mm"))
    items += _norm("kv_norm", T, args.kv_lora_rank, a)
    items.append(Item("wkv_b", T * H * (args.qk_nope_head_dim + args.v_head_dim) * a, False, "mm"))
    bhs = sh.B * H * sh.S
    if sdpa == "math":
        # math path: q and k scaled copies and v made contiguous for the bmms, fp32 scores and probabilities
        items += [Item("sdpa.q", bhs * args.qk_head_dim * _F32, True, "mul"),
                  Item("sdpa.k", bhs * args.qk_head_dim * _F32, True, "mul"),
                  Item("sdpa.scores", bhs * sh.S * _F32, False, "mm"),
                  Item("sdpa.probs", bhs * sh.S * _F32, True, "softmax"),
                  Item("sdpa.v", bhs * args.v_head_dim * _F32, True, "other"),
                  Item("sdpa.out", bhs * args.v_head_dim * _F32, False, "mm")]
    else:
        # fused kernels keep q, k (the concatenated copies), the output and the fp32 log-sum-exp; with padded v
        # also the padded copy, and the output has q/k's head dim
        dv = args.qk_head_dim if sdpa == "flash_padded_v" else args.v_head_dim
        if sdpa == "flash_padded_v":
            items.append(Item("sdpa.v_padded", bhs * dv * a, True, "other"))
        items += [Item("sdpa.q", bhs * args.qk_head_dim * a, True, "other"),
                  Item("sdpa.k", bhs * args.qk_head_dim * a, True, "other"),
                  Item("sdpa.out", bhs * dv * a, True, "attention"),
                  Item("sdpa.lse", bhs * _F32, True, "attention")]
    items.append(Item("wo.input", T * H * args.v_head_dim * a, True, "other"))
    items.append(Item("wo", T * D * a, False, "mm"))
    items += _norm("ffn_norm", T, D, a)
    if not moe:
        return items + _swiglu("feed_forward", T, D, args.inter_dim, a, "mm")
    E, K = args.n_routed_experts, args.n_activated_experts
    N = T * K  # rows into the experts of this rank: T * top_k on average, whatever the EP degree
    P = padded_rows(N, E // sh.ep, expert_align)  # the same rows in the padded layout the grouped GEMMs run on
    I = args.moe_inter_dim
    if a != _F32:
        items.append(Item("router.x_fp32", T * D * _F32, True, "other"))
    items += [Item("router.gate", T * E * _F32, False, "mm"),
              Item("router.scores", T * E * _F32, True, "softmax"),
              Item("router.topk", T * K * (_I64 + _F32), True, "topk"),
              Item("dispatch.order", 2 * N * _I64, True, "other"),
              Item("experts.x", P * D * a, True, "other"),
              Item("experts.w1", P * I * a, True, "grouped_mm"),
              Item("experts.w3", P * I * a, True, "grouped_mm"),
              Item("experts.silu", P * I * a, True, "silu"),
              Item("experts.prod", P * I * a, True, "mul"),
              Item("experts.w2", P * D * a, False, "grouped_mm"),
              Item("experts.y", N * D * a, True, "other"),
              Item("combine.weights_index", N * (_F32 + _I64), True, "other")]
    if P > N:
        items.append(Item("experts.padded_row", N * _I64, True, "other"))  # where each row went, for the way back
    if sh.ep > 1:
        # all-to-all outputs (tokens there and back) and the regrouping indices
        items += [Item("ep.recv", N * D * a, False, "all_to_all"),
                  Item("ep.back", N * D * a, False, "all_to_all"),
                  Item("ep.regroup", 2 * N * _I64, True, "other")]
    if args.n_shared_experts:
        items += _swiglu("shared_experts", T, D, I * args.n_shared_experts, a, "mm")
    if aux_loss:
        items.append(Item("aux_loss", 2 * T * E * _F32, True, "other"))
    return items


def _unit_numel(args: ModelArgs) -> dict[str, int]:
    """Parameter count of the pieces FSDP gathers as units (full, before any sharding)."""
    D, H = args.dim, args.n_heads
    q = D * H * args.qk_head_dim if not args.q_lora_rank else (
        D * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * H * args.qk_head_dim)
    attn = q + D * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank + \
        args.kv_lora_rank * H * (args.qk_nope_head_dim + args.v_head_dim) + H * args.v_head_dim * D + 2 * D
    shared = 3 * D * args.moe_inter_dim * args.n_shared_experts
    return {"embedding": args.vocab_size * D, "head": args.vocab_size * D + D,
            "dense_block": attn + 3 * D * args.inter_dim,
            "moe_block": attn + shared + args.n_routed_experts * D,
            "experts": 3 * args.n_routed_experts * D * args.moe_inter_dim}


def fp8_backward_extra(args: ModelArgs, moe: bool, sh: Shape, selection: Fp8Selection,
                       expert_align: int) -> tuple[int, int]:
    """(attention, FFN) half of a block: the most any one of its FP8 GEMMs' backward allocates beyond the
    high-precision backward (`quantization.fp8.accounting.gemm_backward_extra_bytes`); (0, 0) with recipe none."""
    if selection.recipe == "none":
        return 0, 0
    extra = {"attention": 0, "ffn": 0}
    N = sh.T * args.n_activated_experts
    for fqn, gemms in block_gemms(args, moe).items():
        if not selection.selects(fqn):
            continue
        half = "attention" if fqn.startswith("attention.") else "ffn"
        for k, n, copies in gemms:
            experts = copies // sh.ep if copies > 1 else 0
            rows = padded_rows(N, experts, expert_align) if experts else sh.T
            b = gemm_backward_extra_bytes(selection.recipe, rows, k, n, sh.act, experts)
            extra[half] = max(extra[half], b)
    return extra["attention"], extra["ffn"]


def _block(args: ModelArgs, layer: int, sh: Shape, aux_loss: bool, units: dict[str, int], unit_bytes: dict[str, int],
           shard: int, selection: Fp8Selection) -> BlockMemory:
    T, a = sh.T, sh.act
    moe = layer >= args.n_dense_layers
    fp8_experts = moe and selection.recipe != "none" and selection.selects("moe.experts")
    align = expert_row_align(sh, fp8_experts)
    items = block_items(args, moe, sh, aux_loss, align)
    ffn = sum(it.nbytes for it in items if it.saved and it.name.startswith(_FFN_PREFIXES))
    # the attention backward holds the score gradient and the softmax gradient at once (math path)
    attn_ws = 2 * sh.B * args.n_heads * sh.S * sh.S * _F32 if sdpa_path(sh) == "math" else \
        3 * T * args.n_heads * args.qk_head_dim * a
    hidden = args.moe_inter_dim * max(args.n_shared_experts, 1) if moe else args.inter_dim
    ffn_ws = 3 * max(T * args.n_activated_experts * args.moe_inter_dim if moe else 0, T * hidden) * a
    if moe and sh.ep > 1:
        ffn_ws += 2 * T * args.n_activated_experts * args.dim * a  # all-to-all buffers of the gradients
    fp8_attn, fp8_ffn = fp8_backward_extra(args, moe, sh, selection, align)
    attn_ws += fp8_attn
    ffn_ws += fp8_ffn
    unit = unit_bytes["moe_block" if moe else "dense_block"] + (unit_bytes["experts"] if moe else 0)
    local_numel = (units["moe_block"] + units["experts"] // sh.ep) // shard if moe else \
        units["dense_block"] // shard
    return BlockMemory(layer, items, ffn, attn_ws, ffn_ws, unit, local_numel * 4)


def stage_memory(args: ModelArgs, moe_cfg: MoESection, fp8_cfg, sh: Shape, names: list[str] | None,
                 gather_bytes: int, shard: int) -> StageMemory:
    """The memory of the model part holding the pipeline units `names` (None: the whole model), for one
    microbatch of shape `sh`, with the aux loss of `moe_cfg` and the FP8 recipe of `fp8_cfg`; FSDP gathers
    parameters in `gather_bytes` per element over `shard` ranks."""
    names = ["tok_embeddings", "norm", "output"] if names is None else names
    layers = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
    # a part without blocks is planned with all of them (an over-estimate kept from the first version)
    layers = layers or list(range(args.n_layers))
    T, D, V, a = sh.T, args.dim, args.vocab_size, sh.act
    units = _unit_numel(args)
    # FSDP units this rank gathers: dense parts over the dense mesh, experts over what is left after EP
    unit_bytes = {"embedding": units["embedding"] * gather_bytes, "head": units["head"] * gather_bytes,
                  "dense_block": units["dense_block"] * gather_bytes, "moe_block": units["moe_block"] * gather_bytes,
                  "experts": units["experts"] // sh.ep * gather_bytes}
    aux_loss = moe_cfg.aux_loss_coeff > 0
    selection = fp8_selection(fp8_cfg, MODULE_DEFAULTS)
    n_moe = sum(1 for i in layers if i >= args.n_dense_layers)
    rope_tables = 2 * args.max_seq_len * args.qk_rope_head_dim // 2 * _F32  # cos and sin
    return StageMemory(
        blocks=[_block(args, i, sh, aux_loss, units, unit_bytes, shard, selection) for i in layers],
        first="tok_embeddings" in names, last="output" in names,
        embedding_kept=T * _I64, embedding_unit_bytes=unit_bytes["embedding"],
        head_kept=3 * T * D * a + T * V * _F32,  # final norm, output input, log_softmax out
        head_unit_bytes=unit_bytes["head"], head_grad_bytes=(units["head"] // shard) * 4,
        logits=(T, V), hidden_bytes=T * D * a,
        largest_local_param=max(V * D, args.n_routed_experts * D * args.moe_inter_dim // sh.ep) * 4 // shard,
        buffer_bytes=rope_tables + 3 * args.n_routed_experts * _F32 * n_moe,
        ep_buffers=2 * T * args.n_activated_experts * D * a if sh.ep > 1 else 0)
