"""DeepSeek-V3's side of the memory plan (`trainer/memory_plan.py`): the tensors each block creates in forward,
the backward working sets, the FSDP units and the buffers, from the model args and one microbatch's shape.

Expert rows are sized at `Shape.skew` times the balanced mean (every expert rank receives T * top_k rows on
average; skew 1: balanced routing). Parameter shapes come from a meta-device build of the model. See
docs/memory.md, "Memory plan".
"""

from __future__ import annotations

import dataclasses
import math

import torch

from core.quantization import FP8_TILE
from quantization.fp8.accounting import FP8_GATHER_BYTES, gemm_backward_extra_bytes
from quantization.fp8.config import Fp8Selection, fp8_selection
from quantization.fp8.fsdp_all_gather import gathers_blocks
from core.memory_types import BlockMemory, Item, Shape, StageMemory
from core.model_config import MoESection

from .args import ModelArgs
from .flops import block_gemms
from .model import DeepSeekV3Model
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


def received_rows(args: ModelArgs, sh: Shape) -> int:
    """Rows the planned expert rank receives: T * top_k on average whatever the EP degree, `sh.skew` times that
    under skewed routing, at most every row the EP group's tokens can send to this rank's experts."""
    N = sh.T * args.n_activated_experts
    if sh.ep == 1:
        return N
    most = sh.ep * sh.T * min(args.n_activated_experts, args.n_routed_experts // sh.ep)
    return min(math.ceil(N * sh.skew), most)


def block_items(args: ModelArgs, moe: bool, sh: Shape, aux_loss: bool = False, expert_align: int = 1,
                wire_bytes: float = 0.0) -> list[Item]:
    """Every tensor of interest one transformer block creates in forward, for one microbatch, with the forward FLOPs
    of the matmuls and of attention; the routed experts' rows are those this rank receives (`received_rows`), padded
    to multiples of `expert_align` (`moe.padded_rows`: a fixed-size layout), dispatched in `wire_bytes` per element
    (0: the compute dtype's)."""
    T, a, D, H = sh.T, sh.act, args.dim, args.n_heads
    sdpa = sdpa_path(sh)
    items = [Item("input", T * D * a, True, "input")]
    items += _norm("attention_norm", T, D, a)
    q_out = H * args.qk_head_dim
    if args.q_lora_rank:
        items.append(Item("wq_a", T * args.q_lora_rank * a, True, "mm", 2 * T * D * args.q_lora_rank))
        items += _norm("q_norm", T, args.q_lora_rank, a)
        items.append(Item("wq_b", T * q_out * a, False, "mm", 2 * T * args.q_lora_rank * q_out))
    else:
        items.append(Item("wq", T * q_out * a, False, "mm", 2 * T * D * q_out))
    kv_a = args.kv_lora_rank + args.qk_rope_head_dim
    # context parallelism: the whole sequences' latents are gathered (wkv_a's own output is then not kept) and
    # up-projected, so keys and values have Tk = T * cp rows (`model.MLA.forward`)
    Tk, Sk = T * sh.cp, sh.S * sh.cp
    items.append(Item("wkv_a", T * kv_a * a, sh.cp == 1, "mm", 2 * T * D * kv_a))
    if sh.cp > 1:
        items.append(Item("cp.kv_gathered", Tk * kv_a * a, True, "all_gather"))
    items += _norm("kv_norm", Tk, args.kv_lora_rank, a)
    kv_b = H * (args.qk_nope_head_dim + args.v_head_dim)
    items.append(Item("wkv_b", Tk * kv_b * a, False, "mm", 2 * Tk * args.kv_lora_rank * kv_b))
    bhs = sh.B * H * sh.S
    # causal attention: half the whole sequence's score matrix is useful work (the FLOPs the metrics count), a
    # 1 / cp share of it per rank
    score_flops, value_flops = bhs * Sk * args.qk_head_dim, bhs * Sk * args.v_head_dim
    # rows of keys the kernels read and scores they compute: the whole square without context parallelism; with
    # it, each of the rank's two chunks (L rows) against the keys up to its end, (2 cp + 1) L keys in all
    key_rows, scores = bhs, bhs * sh.S
    if sh.cp > 1:
        L = sh.S // 2
        key_rows, scores = sh.B * H * (2 * sh.cp + 1) * L, sh.B * H * L * (2 * sh.cp + 1) * L
    if sdpa == "math":
        # math path: q and k scaled copies and v made contiguous for the bmms, fp32 scores and probabilities
        items += [Item("sdpa.q", bhs * args.qk_head_dim * _F32, True, "mul"),
                  Item("sdpa.k", key_rows * args.qk_head_dim * _F32, True, "mul"),
                  Item("sdpa.scores", scores * _F32, False, "mm", score_flops),
                  Item("sdpa.probs", scores * _F32, True, "softmax"),
                  Item("sdpa.v", key_rows * args.v_head_dim * _F32, True, "other"),
                  Item("sdpa.out", bhs * args.v_head_dim * _F32, False, "mm", value_flops)]
    else:
        # fused kernels keep q, k (the concatenated copies, the whole sequences' under context parallelism), the
        # output and the fp32 log-sum-exp; with padded v also the padded copy, and the output has q/k's head dim
        dv = args.qk_head_dim if sdpa == "flash_padded_v" else args.v_head_dim
        if sdpa == "flash_padded_v":
            items.append(Item("sdpa.v_padded", bhs * sh.cp * dv * a, True, "other"))
        items += [Item("sdpa.q", bhs * args.qk_head_dim * a, True, "other"),
                  Item("sdpa.k", bhs * sh.cp * args.qk_head_dim * a, True, "other"),
                  Item("sdpa.out", bhs * dv * a, True, "attention", score_flops + bhs * Sk * dv),
                  Item("sdpa.lse", bhs * _F32, True, "attention")]
    items.append(Item("wo.input", T * H * args.v_head_dim * a, True, "other"))
    items.append(Item("wo", T * D * a, False, "mm", 2 * T * H * args.v_head_dim * D))
    items += _norm("ffn_norm", T, D, a)
    if not moe:
        return items + _swiglu("feed_forward", T, D, args.inter_dim, a, "mm")
    E, K = args.n_routed_experts, args.n_activated_experts
    N = T * K  # rows this rank sends to the experts (its tokens times top_k)
    R = received_rows(args, sh)  # rows its experts receive
    P = padded_rows(R, E // sh.ep, expert_align)  # the same rows in the padded layout the grouped GEMMs run on
    I = args.moe_inter_dim
    if a != _F32:
        items.append(Item("router.x_fp32", T * D * _F32, True, "other"))
    items += [Item("router.gate", T * E * _F32, False, "mm", 2 * T * D * E),
              Item("router.scores", T * E * _F32, True, "softmax"),
              Item("router.topk", T * K * (_I64 + _F32), True, "topk"),
              Item("dispatch.order", 2 * N * _I64, True, "other"),
              Item("experts.x", P * D * a, True, "other"),
              Item("experts.w1", P * I * a, True, "grouped_mm", 2 * P * D * I),
              Item("experts.w3", P * I * a, True, "grouped_mm", 2 * P * D * I),
              Item("experts.silu", P * I * a, True, "silu"),
              Item("experts.prod", P * I * a, True, "mul"),
              Item("experts.w2", P * D * a, False, "grouped_mm", 2 * P * I * D),
              Item("experts.y", R * D * a, True, "other"),
              Item("combine.weights_index", N * (_F32 + _I64), True, "other")]
    if P > R:
        items.append(Item("experts.padded_row", R * _I64, True, "other"))  # where each row went, for the way back
    if sh.ep > 1:
        # all-to-all outputs (tokens there and back) and the regrouping indices; FP8 dispatch receives e4m3 rows
        # and their scales, dequantised on arrival: after the exchange op, or inside it (then the op's output is
        # in the compute dtype)
        if wire_bytes and not sh.fp8_dispatch_in_op:
            items += [Item("ep.recv", math.ceil(R * D * wire_bytes), False, "all_to_all"),
                      Item("ep.recv_dequantised", R * D * a, False, "other")]
        else:
            items.append(Item("ep.recv", R * D * a, False, "all_to_all"))
        items += [Item("ep.back", N * D * a, False, "all_to_all"),
                  Item("ep.regroup", 2 * R * _I64, True, "other"),
                  # the top-k ids and weights of each received token (at most R tokens, at most T per EP rank)
                  Item("ep.routing", min(R, sh.ep * T) * K * (_I64 + _F32), False, "routing")]
    if args.n_shared_experts:
        items += _swiglu("shared_experts", T, D, I * args.n_shared_experts, a, "mm")
    if aux_loss:
        items.append(Item("aux_loss", 2 * T * E * _F32, True, "other"))
    return items


def _is_expert(name: str) -> bool:
    """Whether parameter `name` is a routed expert's (split over EP, FSDP-sharded over what is left)."""
    return ".moe.experts." in name


_SHAPES: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}


def param_shapes(args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every parameter of `DeepSeekV3Model(args)`, read from a meta-device build (once per
    args): the model itself is the one source of its shapes."""
    key = dataclasses.astuple(args)
    if key not in _SHAPES:
        with torch.device("meta"):
            model = DeepSeekV3Model(args)
        _SHAPES[key] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return _SHAPES[key]


def local_numel(name: str, shape: tuple[int, ...], ep: int, shard: int) -> int:
    """Elements of parameter `name` on the first rank of its FSDP group: experts split over `ep` ranks on dim 0 and
    the rest FSDP-sharded on dim 0 over the `shard / ep` ranks left; other weights sharded over `shard` ranks.
    FSDP2 pads dim 0 to a multiple of the group, so the first rank holds ceil(dim 0 / group) rows."""
    rows, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
    if _is_expert(name):
        rows, shard = rows // ep, shard // ep
    return -(-rows // shard) * rest


def _unit_of(name: str) -> str:
    """The pipeline unit a parameter belongs to: `layers.3` for `layers.3.attention.wq.weight`, else its first
    component (`tok_embeddings`, `norm`, `output`, `mtp`)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


_UNITS: dict[tuple, dict[str, list[tuple[str, tuple[int, ...]]]]] = {}
_BLOCKS: dict[tuple, BlockMemory] = {}
_LOCAL: dict[tuple, tuple[int, int]] = {}


def _unit_local(args: ModelArgs, key: tuple, unit: str, ep: int, shard: int) -> tuple[int, int]:
    """(elements, largest parameter's elements) of pipeline unit `unit` on the first rank of its FSDP group."""
    cache_key = (key, unit, ep, shard)
    if cache_key not in _LOCAL:
        sizes = [local_numel(n, shape, ep, shard) for n, shape in _unit_params(args, key).get(unit, [])]
        _LOCAL[cache_key] = (sum(sizes), max(sizes, default=0))
    return _LOCAL[cache_key]


def _unit_params(args: ModelArgs, key: tuple) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """`param_shapes` grouped by pipeline unit (`_unit_of`)."""
    if key not in _UNITS:
        units: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, shape in param_shapes(args):
            units.setdefault(_unit_of(name), []).append((name, shape))
        _UNITS[key] = units
    return _UNITS[key]


def fp8_backward_extra(args: ModelArgs, moe: bool, sh: Shape, selection: Fp8Selection,
                       expert_align: int, weights_cast: bool = False,
                       gathered: frozenset[str] = frozenset()) -> tuple[int, int]:
    """(attention, FFN) half of a block: the most any one of its FP8 GEMMs' backward allocates beyond the
    high-precision backward (`quantization.fp8.accounting.gemm_backward_extra_bytes`); (0, 0) with recipe none.
    `weights_cast`: the GEMMs get copies of the weights cast to the compute dtype (autocast without FSDP), so
    blockwise saves the forward's quantised weight for the dgrad; `gathered`: the modules whose weights FSDP
    gathers as FP8 blocks (those of `fp8_gathered_params`)."""
    if selection.recipe == "none":
        return 0, 0
    kept = weights_cast and selection.recipe == "blockwise"
    extra = {"attention": 0, "ffn": 0}
    N = received_rows(args, sh) if moe else 0
    for fqn, gemms in block_gemms(args, moe).items():
        if not selection.selects(fqn):
            continue
        half = "attention" if fqn.startswith("attention.") else "ffn"
        for k, n, copies in gemms:
            experts = copies // sh.ep if copies > 1 else 0
            rows = padded_rows(N, experts, expert_align) if experts else sh.T
            # whole 128 x 128 blocks only (`quantization.fp8.gemms._keeps_weight`)
            whole = k % FP8_TILE == 0 and n % FP8_TILE == 0
            b = gemm_backward_extra_bytes(selection.recipe, rows, k, n, sh.act, experts, weight_kept=kept and whole,
                                          weight_gathered=fqn in gathered)
            extra[half] = max(extra[half], b)
    return extra["attention"], extra["ffn"]


def _module_of(name: str) -> str:
    """The block-relative module of parameter `name`: `attention.wq` for `layers.3.attention.wq.weight`."""
    return name.split(".", 2)[2].rpartition(".")[0]


def fp8_gathered_params(args: ModelArgs, moe: bool, sh: Shape, params: list[tuple[str, tuple[int, ...]]],
                        shard: int, selection: Fp8Selection) -> frozenset[str]:
    """The parameters of a block (its `params`: (name, shape)) that FSDP gathers as blocks over `shard` ranks with
    `fp8.all_gather`, as `quantization.fp8.convert.apply_fp8_all_gather` wraps them: the blockwise FP8 modules'
    weights whose every shard holds whole 128 x 128 blocks (routed experts: this EP rank's, sharded over the
    `shard / ep` ranks left). The routed experts count as gathered as blocks: the plan does not know whether the
    GPU has DeepGEMM, whose experts gather in bf16 (docs/fp8.md)."""
    if selection.recipe != "blockwise":
        return frozenset()
    gemms = block_gemms(args, moe)
    return frozenset(
        name for name, shape in params
        if _module_of(name) in gemms and selection.selects(_module_of(name)) and
        (gathers_blocks((shape[0] // sh.ep, *shape[1:]), shard // sh.ep) if _is_expert(name) else
         gathers_blocks(shape, shard)))


def _block(args: ModelArgs, layer: int, sh: Shape, aux_loss: bool, params: list[tuple[str, tuple[int, ...]]],
           gather_bytes: int, shard: int, selection: Fp8Selection, fp8_gather: bool) -> BlockMemory:
    T, a = sh.T, sh.act
    moe = layer >= args.n_dense_layers
    fp8_experts = moe and selection.recipe != "none" and selection.selects("moe.experts")
    align = expert_row_align(sh, fp8_experts)
    wire = sh.fp8_dispatch_bytes if fp8_experts else 0.0
    items = block_items(args, moe, sh, aux_loss, align, wire)
    ffn = sum(it.nbytes for it in items if it.saved and it.name.startswith(_FFN_PREFIXES))
    # the attention backward holds the score gradient and the softmax gradient at once (math path); with context
    # parallelism those of its longest chunk (L rows against 2 cp L keys), and the gradients of the whole
    # sequences' keys and values, which the chunks' backwards add into
    if sh.cp == 1:
        attn_ws = 2 * sh.B * args.n_heads * sh.S * sh.S * _F32 if sdpa_path(sh) == "math" else \
            3 * T * args.n_heads * args.qk_head_dim * a
    else:
        g = _F32 if sdpa_path(sh) == "math" else a
        kv_grads = T * sh.cp * args.n_heads * (args.qk_head_dim + args.v_head_dim) * g
        L = sh.S // 2
        attn_ws = kv_grads + (2 * sh.B * args.n_heads * L * 2 * sh.cp * L * _F32 if sdpa_path(sh) == "math" else
                              3 * T * args.n_heads * args.qk_head_dim * a)
    hidden = args.moe_inter_dim * max(args.n_shared_experts, 1) if moe else args.inter_dim
    received = received_rows(args, sh) if moe else 0
    ffn_ws = 3 * max(received * args.moe_inter_dim, T * hidden) * a
    a2a = a2a_grad = 0
    if moe and sh.ep > 1:
        sent = T * args.n_activated_experts
        ffn_ws += (sent + received) * args.dim * a  # all-to-all buffers of the gradients, there and back
        rows = max(sent, received) * args.dim
        a2a = math.ceil(rows * ((wire or a) + a))  # dispatch (FP8 or the compute dtype) and combine
        a2a_grad = 2 * rows * a
    gathered = fp8_gathered_params(args, moe, sh, params, shard, selection) if fp8_gather else frozenset()
    # parameters gathered (or held) in more bytes than the compute dtype's: the GEMMs get cast copies
    fp8_attn, fp8_ffn = fp8_backward_extra(args, moe, sh, selection, align, weights_cast=gather_bytes > a,
                                           gathered=frozenset(map(_module_of, gathered)))
    attn_ws += fp8_attn
    ffn_ws += fp8_ffn
    # FSDP gathers the block's dense weights whole and the experts' weights of this EP rank, the FP8 modules'
    # as blocks where `gathered`
    numel = {n: math.prod(shape) // (sh.ep if _is_expert(n) else 1) for n, shape in params}
    local = {n: local_numel(n, shape, sh.ep, shard) for n, shape in params}
    fp8_numel = sum(numel[n] for n in gathered)
    unit = (sum(numel.values()) - fp8_numel) * gather_bytes + math.ceil(fp8_numel * FP8_GATHER_BYTES)
    return BlockMemory(layer, items, ffn, attn_ws, ffn_ws, unit_bytes=unit, unit_elements=sum(numel.values()),
                       grad_bytes=sum(local.values()) * 4, a2a_bytes=a2a, a2a_grad_bytes=a2a_grad,
                       fp8_gathered=fp8_numel,
                       fp8_gathered_shard=sum(local[n] for n in gathered))


def stage_memory(args: ModelArgs, moe_cfg: MoESection, fp8_cfg, sh: Shape, names: list[str] | None,
                 gather_bytes: int, shard: int) -> StageMemory:
    """The memory of the model part holding the pipeline units `names` (None: the whole model), for one
    microbatch of shape `sh`, with the aux loss of `moe_cfg` and the FP8 recipe of `fp8_cfg`; FSDP gathers
    parameters in `gather_bytes` per element over `shard` ranks (the first rank of the group is planned)."""
    key = dataclasses.astuple(args)
    units = _unit_params(args, key)
    owned = list(units) if names is None else [n for n in names if n in units]
    if names is None:
        names, layers = ["tok_embeddings", "norm", "output"], list(range(args.n_layers))
    else:
        layers = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
    T, D, V, a = sh.T, args.dim, args.vocab_size, sh.act
    aux_loss = moe_cfg.aux_loss_coeff > 0
    selection = fp8_selection(fp8_cfg, MODULE_DEFAULTS)
    fp8_gather = fp8_cfg.all_gather and shard > 1
    n_moe = sum(1 for i in layers if i >= args.n_dense_layers)
    rope_tables = 2 * args.max_seq_len * args.qk_rope_head_dim // 2 * _F32  # cos and sin

    def of(*unit_names: str) -> list[tuple[str, tuple[int, ...]]]:
        return [p for u in unit_names for p in units.get(u, [])]

    def block(i: int) -> BlockMemory:
        # blocks of one kind (dense or MoE) differ only in their index
        moe = i >= args.n_dense_layers
        block_key = (key, moe, sh, aux_loss, gather_bytes, shard, selection, fp8_gather)
        if block_key not in _BLOCKS:
            if len(_BLOCKS) > 4096:
                _BLOCKS.clear()
            _BLOCKS[block_key] = _block(args, i, sh, aux_loss, of(f"layers.{i}"), gather_bytes, shard, selection,
                                        fp8_gather)
        return dataclasses.replace(_BLOCKS[block_key], layer=i)

    def full(params) -> int:
        return sum(math.prod(shape) for _, shape in params)

    def local(*unit_names: str) -> int:
        return sum(_unit_local(args, key, u, sh.ep, shard)[0] for u in unit_names)

    head = of("norm", "output")
    return StageMemory(
        blocks=[block(i) for i in layers],
        first="tok_embeddings" in names, last="output" in names,
        embedding_kept=T * _I64, embedding_unit_bytes=full(of("tok_embeddings")) * gather_bytes,
        head_kept=3 * T * D * a + T * V * _F32,  # final norm, output input, log_softmax out
        head_unit_bytes=full(head) * gather_bytes, head_grad_bytes=local("norm", "output") * 4,
        logits=(T, V), hidden_bytes=T * D * a,
        largest_local_param=max(_unit_local(args, key, u, sh.ep, shard)[1] for u in owned or units) * 4,
        buffer_bytes=rope_tables + 3 * args.n_routed_experts * _F32 * n_moe,
        ep_buffers=2 * T * args.n_activated_experts * D * a if sh.ep > 1 else 0,
        param_numel=local(*owned), head_flops=2 * T * D * V)
