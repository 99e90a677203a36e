"""DeepSeek-V3 model arguments and the published flavors.

Every shape the model builds comes from `ModelArgs`; nothing else in `models/deepseek_v3/` hard-codes a size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ModelArgs:
    """Hyper-parameters of a DeepSeek-V3 (or V2-shaped) model.

    Names follow DeepSeek's own `inference/model.py`; `models/deepseek_v3/hf/config.py` maps them to HF config keys.
    """

    vocab_size: int = 2048
    dim: int = 256
    inter_dim: int = 1024  # hidden size of the dense SwiGLU FFN layers
    moe_inter_dim: int = 256  # hidden size of each routed / shared expert
    n_layers: int = 6
    n_dense_layers: int = 1  # the first n layers use a dense FFN instead of MoE
    n_heads: int = 16
    norm_eps: float = 1e-6
    max_seq_len: int = 2048  # longest sequence the RoPE tables cover

    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 2
    n_activated_experts: int = 3  # top-k
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: str = "softmax"  # "sigmoid" (V3) or "softmax" (V2)
    group_score_func: str = "top2_sum"  # V3 sums a group's top-2 scores; V2 takes the group max
    route_norm: bool = False  # normalise the top-k weights to sum to 1
    route_scale: float = 1.0
    use_grouped_mm: bool = True  # False: per-expert loop (the reference oracle; syncs with the host)

    # MLA
    q_lora_rank: int = 0  # 0 = plain q projection
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    document_masking: bool = False  # no attention across EOS tokens (needs eos_id)
    eos_id: int = -1

    # YaRN
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0

    # multi-token prediction (DeepSeek-V3 section 2.2)
    num_mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_enabled(self) -> bool:
        """YaRN blends frequencies only when the model must reach past its pre-training context."""
        return self.max_seq_len > self.original_seq_len and self.rope_factor > 1.0

    def replace(self, **changes) -> "ModelArgs":
        """A copy with some fields changed (flavors are shared; never mutate them)."""
        return dataclasses.replace(self, **changes)

    def check(self) -> list[str]:
        """Return a list of problems ("field: why"); empty when the args describe a buildable model."""
        problems = []
        positive = ["vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads", "kv_lora_rank",
                    "qk_rope_head_dim", "v_head_dim", "max_seq_len", "n_routed_experts", "n_activated_experts"]
        for name in positive:
            if getattr(self, name) <= 0:
                problems.append(f"{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            problems.append(f"n_dense_layers: must be in [0, n_layers={self.n_layers}], got {self.n_dense_layers}")
        if self.score_func not in ("sigmoid", "softmax"):
            problems.append(f"score_func: allowed sigmoid, softmax; got {self.score_func!r}")
        if self.group_score_func not in ("top2_sum", "max"):
            problems.append(f"group_score_func: allowed top2_sum, max; got {self.group_score_func!r}")
        if self.n_activated_experts > self.n_routed_experts:
            problems.append("n_activated_experts: must be <= n_routed_experts")
        if self.n_routed_experts % self.n_expert_groups:
            problems.append("n_expert_groups: must divide n_routed_experts")
        if not 1 <= self.n_limited_groups <= self.n_expert_groups:
            problems.append("n_limited_groups: must be in [1, n_expert_groups]")
        if self.n_expert_groups > 1:
            per_group_needed = 2 if self.group_score_func == "top2_sum" else 1
            if self.n_routed_experts // self.n_expert_groups < per_group_needed:
                problems.append("n_expert_groups: each group needs at least 2 experts for top-2 group scores")
            if self.n_limited_groups * (self.n_routed_experts // self.n_expert_groups) < self.n_activated_experts:
                problems.append("n_limited_groups: the kept groups hold fewer experts than n_activated_experts")
        if self.qk_rope_head_dim % 2:
            problems.append("qk_rope_head_dim: must be even")
        if self.document_masking and self.eos_id < 0:
            problems.append("document_masking: needs eos_id")
        return problems


_V3_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

FLAVORS: dict[str, ModelArgs] = {
    # Tiny: trains on CPU in seconds; shapes as torchtitan's debug model (MLA head dims as the real model). RoPE
    # tables for 8192 tokens (context-parallel runs and benchmarks reach 8192) without YaRN.
    "debugmodel": ModelArgs(
        vocab_size=2048, dim=256, inter_dim=1024, moe_inter_dim=256, n_layers=6, n_dense_layers=1, n_heads=16,
        norm_eps=1e-6, max_seq_len=8192, original_seq_len=8192,
        n_routed_experts=8, n_shared_experts=2, n_activated_experts=3,
        score_func="softmax", route_norm=False, route_scale=1.0, q_lora_rank=0, mscale=0.70, **_V3_MLA,
    ),
    # Sized so one CPU step takes a few seconds (benchmarks/throughput.py with train_configs/cpu_bench.toml).
    "cpu_bench": ModelArgs(
        vocab_size=2048, dim=512, inter_dim=1536, moe_inter_dim=384, n_layers=8, n_dense_layers=1, n_heads=8,
        norm_eps=1e-6, max_seq_len=2048, n_routed_experts=16, n_shared_experts=2, n_activated_experts=4,
        score_func="softmax", route_norm=False, route_scale=1.0, q_lora_rank=0, mscale=0.70,
        kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
    # DeepSeek-V2-Lite shapes (15.7B total, 2.4B active per token).
    "16B": ModelArgs(
        vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408, n_layers=27, n_dense_layers=1,
        n_heads=16, norm_eps=1e-6, max_seq_len=4096, n_routed_experts=64, n_shared_experts=2,
        n_activated_experts=6, score_func="softmax", route_norm=False, route_scale=1.0, q_lora_rank=0,
        mscale=0.707, **_V3_MLA,
    ),
    # DeepSeek-V2 shapes (236B total, 21B active): softmax scores, group-limited routing by group max.
    "236B": ModelArgs(
        vocab_size=102400, dim=5120, inter_dim=12288, moe_inter_dim=1536, n_layers=60, n_dense_layers=1,
        n_heads=128, norm_eps=1e-6, max_seq_len=4096, n_routed_experts=160, n_shared_experts=2,
        n_activated_experts=6, n_expert_groups=8, n_limited_groups=3, score_func="softmax",
        group_score_func="max", route_norm=False, route_scale=16.0, q_lora_rank=1536, mscale=0.707, **_V3_MLA,
    ),
    # DeepSeek-V3 (671B total, 37B active): sigmoid scores, bias-corrected group-limited routing.
    "671B": ModelArgs(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
        n_heads=128, norm_eps=1e-6, max_seq_len=4096, n_routed_experts=256, n_shared_experts=1,
        n_activated_experts=8, n_expert_groups=8, n_limited_groups=4, score_func="sigmoid",
        group_score_func="top2_sum", route_norm=True, route_scale=2.5, q_lora_rank=1536, mscale=1.0, **_V3_MLA,
    ),
}
