"""Parameter counts and training FLOPs per token, computed from `ModelArgs` alone (no model needed).

Used for the published-size checks (671B total / 37B active), by the metrics for TFLOP/s and MFU, and (per module,
`block_flops_per_token`) for the FLOPs an `[fp8]` recipe runs as FP8 GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .args import ModelArgs


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model (buffers such as expert_bias are not parameters)."""

    total: int
    active: int  # per token: routed experts counted at top_k / n_routed_experts
    embedding: int
    routed_experts: int
    mtp: int


def block_gemms(a: ModelArgs, moe: bool) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """The weight GEMMs of each linear and of the routed experts of one block, by block-relative FQN: the modules
    `[fp8]` can convert (the router gate and the norms are left out). Each is (in_features, out_features, copies):
    copies is the number of routed experts for their stacked weights (w1 and w3: dim -> hidden, w2: hidden -> dim).
    The memory plan sizes FP8 working memory from these shapes."""
    qk = a.n_heads * a.qk_head_dim
    gemms = ({"attention.wq": ((a.dim, qk, 1),)} if a.q_lora_rank == 0
             else {"attention.wq_a": ((a.dim, a.q_lora_rank, 1),), "attention.wq_b": ((a.q_lora_rank, qk, 1),)})
    gemms["attention.wkv_a"] = ((a.dim, a.kv_lora_rank + a.qk_rope_head_dim, 1),)
    gemms["attention.wkv_b"] = ((a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), 1),)
    gemms["attention.wo"] = ((a.n_heads * a.v_head_dim, a.dim, 1),)
    if not moe:
        ffns = {"feed_forward": a.inter_dim}
    else:
        E, hidden = a.n_routed_experts, a.moe_inter_dim
        gemms["moe.experts"] = ((a.dim, hidden, E), (a.dim, hidden, E), (hidden, a.dim, E))
        ffns = {"moe.shared_experts": a.moe_inter_dim * a.n_shared_experts} if a.n_shared_experts else {}
    for ffn, hidden in ffns.items():
        gemms.update({f"{ffn}.w1": ((a.dim, hidden, 1),), f"{ffn}.w2": ((hidden, a.dim, 1),),
                      f"{ffn}.w3": ((a.dim, hidden, 1),)})
    return gemms


def _block_module_params(a: ModelArgs, moe: bool) -> dict[str, int]:
    """Parameters of each module of `block_gemms` (the routed experts: all of them)."""
    return {fqn: sum(i * o * copies for i, o, copies in shapes) for fqn, shapes in block_gemms(a, moe).items()}


def _block_params(a: ModelArgs, moe: bool) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) of one transformer block."""
    modules = _block_module_params(a, moe)
    norms = 2 * a.dim + a.kv_lora_rank + a.q_lora_rank  # attention and FFN norms, MLA's kv_norm and q_norm
    gate = a.n_routed_experts * a.dim if moe else 0
    return sum(modules.values()) + norms + gate, modules.get("moe.experts", 0)


def _block_kinds(a: ModelArgs, n_blocks: int, first: int = 0) -> dict[bool, int]:
    """{is MoE: how many} of the blocks first .. first + n_blocks - 1 (MoE from `n_dense_layers` on), kinds with
    none left out."""
    dense = min(max(a.n_dense_layers - first, 0), n_blocks)
    return {moe: n for moe, n in ((False, dense), (True, n_blocks - dense)) if n}


def count_params(a: ModelArgs) -> ParamCounts:
    """Exact parameter counts of `DeepSeekV3Model(a)`, including MTP modules."""
    total, routed = 0, 0
    # blocks of one kind have the same parameters: one count per kind (the planner asks for every layout)
    for moe, n_blocks in _block_kinds(a, a.n_layers).items():
        t, r = _block_params(a, moe)
        total, routed = total + n_blocks * t, routed + n_blocks * r
    embedding = a.vocab_size * a.dim
    total += embedding + a.dim + a.vocab_size * a.dim  # embedding, final norm, output head
    mtp = 0
    for moe, n_blocks in _block_kinds(a, a.num_mtp_layers, first=a.n_layers).items():
        t, r = _block_params(a, moe)
        mtp += n_blocks * (t + 3 * a.dim + 2 * a.dim * a.dim)
        routed += n_blocks * r
    total += mtp
    inactive = routed - routed * a.n_activated_experts // a.n_routed_experts
    return ParamCounts(total=total, active=total - inactive, embedding=embedding, routed_experts=routed, mtp=mtp)


def attention_flops_per_token(a: ModelArgs, seq_len: int, causal: bool = True) -> float:
    """The attention-score part of `training_flops_per_token`: q.k^T and p.v, forward + backward."""
    attention = 6 * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len * (a.n_layers + a.num_mtp_layers)
    return attention / 2 if causal else attention


def training_flops_per_token(a: ModelArgs, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of forward + backward per token: 6 x active matmul parameters + attention scores.

    The embedding lookup is not a matmul and is excluded. Attention per layer costs 2*H*S*(qk + v) FLOPs per token
    forward (q.k^T and p.v); with a causal mask only half of the score matrix is useful work.
    """
    counts = count_params(a)
    return 6.0 * (counts.active - counts.embedding) + attention_flops_per_token(a, seq_len, causal)


def block_flops_per_token(a: ModelArgs) -> dict[str, float]:
    """Training FLOPs per token (6 per active parameter) of each linear and of the routed experts inside the blocks,
    by block-relative FQN (`attention.wkv_a`, `moe.experts`), summed over the main layers and the MTP blocks; routed
    experts at top_k / n_routed_experts, as in `count_params`.

    These are the modules the `[fp8]` section can convert (`quantization.fp8.config.fp8_block_modules` names them
    alike).
    The rest of `training_flops_per_token` always runs in the compute dtype: the attention scores, the output head,
    MTP's eh_proj, the router gates and the norm weights.
    """
    flops: dict[str, float] = {}
    for moe, n_blocks in _block_kinds(a, a.n_layers + a.num_mtp_layers).items():
        for fqn, params in _block_module_params(a, moe).items():
            if fqn == "moe.experts":
                params = params // a.n_routed_experts * a.n_activated_experts
            flops[fqn] = flops.get(fqn, 0.0) + 6.0 * params * n_blocks
    return flops
