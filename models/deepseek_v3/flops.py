"""Parameter counts and training FLOPs per token, computed from `ModelArgs` alone (no model needed).

Used for the published-size checks (671B total / 37B active) and by the metrics for TFLOP/s and MFU.
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


def _attention_params(a: ModelArgs) -> int:
    qk = a.n_heads * a.qk_head_dim
    q = a.dim * qk if a.q_lora_rank == 0 else a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * qk
    kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    kv += a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + a.n_heads * a.v_head_dim * a.dim


def _block_params(a: ModelArgs, moe: bool) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) of one transformer block."""
    norms = 2 * a.dim
    if not moe:
        return _attention_params(a) + norms + 3 * a.dim * a.inter_dim, 0
    routed = a.n_routed_experts * 3 * a.dim * a.moe_inter_dim
    shared = 3 * a.dim * a.moe_inter_dim * a.n_shared_experts
    gate = a.n_routed_experts * a.dim
    return _attention_params(a) + norms + gate + shared + routed, routed


def count_params(a: ModelArgs) -> ParamCounts:
    """Exact parameter counts of `DeepSeekV3Model(a)`, including MTP modules."""
    total, routed = 0, 0
    for layer in range(a.n_layers):
        t, r = _block_params(a, layer >= a.n_dense_layers)
        total, routed = total + t, routed + r
    embedding = a.vocab_size * a.dim
    total += embedding + a.dim + a.vocab_size * a.dim  # embedding, final norm, output head
    mtp = 0
    for k in range(a.num_mtp_layers):
        t, r = _block_params(a, a.n_layers + k >= a.n_dense_layers)
        mtp += t + 3 * a.dim + 2 * a.dim * a.dim
        routed += r
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
