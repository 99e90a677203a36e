"""HF config mapping: a config.json dict of DeepSeek-V3 (`deepseek_v3`) or V2 / V2-Lite (`deepseek_v2`) <->
`ModelArgs`, with one-line refusals for what our model cannot reproduce or HF cannot express."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..args import ModelArgs
from .fp8 import FP8_BLOCK

# Defaults of transformers' DeepseekV3Config / DeepseekV2Config for fields a config.json may omit, plus the hub
# configs' topk_method / scoring_func, which transformers does not read but which say how the checkpoint routes.
_V3_DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=None, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
    norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_interleave=True, attention_bias=False, topk_method="noaux_tc",
    scoring_func="sigmoid",
)
_V2_DEFAULTS = dict(
    vocab_size=102400, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1407, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, n_shared_experts=2, n_routed_experts=64,
    routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=None, topk_group=None, num_experts_per_tok=None, first_k_dense_replace=0,
    norm_topk_prob=False, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_interleave=True, attention_bias=False, topk_method="greedy",
    scoring_func="softmax",
)
_DEFAULTS = {"deepseek_v3": _V3_DEFAULTS, "deepseek_v2": _V2_DEFAULTS}


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_args(cfg: dict, max_pos: int) -> dict:
    """ModelArgs RoPE fields from `rope_parameters` (transformers 5.x) or `rope_scaling` (hub / 4.x)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported HF config: partial_rotary_factor != 1")
    if rope_type == "default":
        # no context extension: YaRN stays off because max_seq_len == original_seq_len
        return dict(rope_theta=theta, original_seq_len=max_pos, rope_factor=1.0)
    if rope_type != "yarn":
        raise ValueError(f"unsupported HF config: rope type {rope_type!r} (supported: default, yarn)")
    # transformers prefers a top-level original_max_position_embeddings over the one inside the rope dict
    original = int(cfg.get("original_max_position_embeddings",
                           rope.get("original_max_position_embeddings", max_pos)))
    factor = rope.get("factor") or max_pos / original
    if not rope.get("truncate", True):
        raise ValueError("unsupported HF config: yarn truncate=false (our YaRN ramp rounds its bounds)")
    if factor < 1:
        raise ValueError(f"unsupported HF config: yarn factor {factor} < 1")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # transformers multiplies cos/sin by this "attention factor"; ours only scales the softmax by mscale_all_dim
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    if abs(attention_factor - 1.0) > 1e-12:
        raise ValueError(f"unsupported HF config: yarn scales cos/sin by {attention_factor:.6g} (mscale={mscale} "
                         f"vs mscale_all_dim={mscale_all_dim}); our model has no such factor")
    if factor > 1 and max_pos <= original:
        raise ValueError(f"unsupported HF config: yarn with max_position_embeddings {max_pos} <= "
                         f"original_max_position_embeddings {original} (our YaRN only extends past the original)")
    return dict(rope_theta=theta, original_seq_len=original, rope_factor=float(factor),
                beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1,
                mscale=float(mscale_all_dim or 0.0))


def _routing_args(model_type: str, c: dict) -> dict:
    """ModelArgs routing fields; V3 = sigmoid + bias + top-2-sum groups, V2 = softmax + greedy / group max."""
    top_k = c["num_experts_per_tok"]
    if top_k is None:
        raise ValueError("unsupported HF config: num_experts_per_tok is missing")
    if model_type == "deepseek_v3":
        if c["scoring_func"] != "sigmoid":
            raise ValueError(f"unsupported HF config: deepseek_v3 scoring_func {c['scoring_func']!r} (HF uses sigmoid)")
        if c["topk_method"] != "noaux_tc":
            raise ValueError(f"unsupported HF config: deepseek_v3 topk_method {c['topk_method']!r} (need noaux_tc)")
        n_group, topk_group = c["n_group"] or 1, c["topk_group"] or 1
        return dict(score_func="sigmoid", group_score_func="top2_sum", n_activated_experts=top_k,
                    n_expert_groups=n_group, n_limited_groups=topk_group, route_norm=bool(c["norm_topk_prob"]),
                    route_scale=float(c["routed_scaling_factor"]))
    if c["scoring_func"] != "softmax":
        raise ValueError(f"unsupported HF config: deepseek_v2 scoring_func {c['scoring_func']!r} (need softmax)")
    if c["topk_method"] == "greedy":
        n_group, topk_group = 1, 1
    elif c["topk_method"] == "group_limited_greedy":
        if not c["n_group"] or not c["topk_group"]:
            raise ValueError("unsupported HF config: group_limited_greedy needs n_group and topk_group")
        n_group, topk_group = c["n_group"], c["topk_group"]
    else:
        raise ValueError(f"unsupported HF config: deepseek_v2 topk_method {c['topk_method']!r} "
                         "(supported: greedy, group_limited_greedy)")
    # DeepSeek-V2's reference code either normalises the top-k weights (top_k > 1 and norm_topk_prob) or scales
    # them by routed_scaling_factor, never both. (transformers 5.x ignores norm_topk_prob for V2; no published
    # V2 checkpoint sets it.)
    normalise = bool(c["norm_topk_prob"]) and top_k > 1
    return dict(score_func="softmax", group_score_func="max", n_activated_experts=top_k, n_expert_groups=n_group,
                n_limited_groups=topk_group, route_norm=normalise,
                route_scale=1.0 if normalise else float(c["routed_scaling_factor"]))


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs for a HF `config.json` dict of a DeepSeek-V3 (`deepseek_v3`) or V2 / V2-Lite (`deepseek_v2`) model.

    Fields the dict omits take transformers' defaults for that model type. `num_nextn_predict_layers` (or
    `num_mtp_layers`) becomes `num_mtp_layers`, 0 when absent. Raises ValueError (one line) for a config our model
    cannot reproduce exactly.
    """
    model_type = cfg.get("model_type")
    if model_type not in _DEFAULTS:
        raise ValueError(f"unsupported HF config: model_type {model_type!r} (supported: {', '.join(_DEFAULTS)})")
    c = {**_DEFAULTS[model_type], **{k: v for k, v in cfg.items() if k in _DEFAULTS[model_type]}}
    heads = c["num_attention_heads"]
    quant, block = cfg.get("quantization_config") or {}, [FP8_BLOCK, FP8_BLOCK]
    checks = [
        (c["hidden_act"] == "silu", f"hidden_act {c['hidden_act']!r} (need silu)"),
        (not c["attention_bias"] and not cfg.get("mlp_bias", False), "attention_bias / mlp_bias (need false)"),
        (not c["tie_word_embeddings"], "tie_word_embeddings=true (our output head is separate)"),
        (c["num_key_value_heads"] in (None, heads), "num_key_value_heads != num_attention_heads"),
        (c["rope_interleave"] or model_type == "deepseek_v2", "rope_interleave=false (our RoPE rotates pairs)"),
        (cfg.get("moe_layer_freq", 1) == 1, f"moe_layer_freq {cfg.get('moe_layer_freq')} (need 1)"),
        (quant.get("quant_method", "fp8") == "fp8" and list(quant.get("weight_block_size", block)) == block,
         f"quantization_config {quant} (only fp8 with {FP8_BLOCK}x{FP8_BLOCK} blocks is dequantized)"),
    ]
    for ok, why in checks:
        if not ok:
            raise ValueError(f"unsupported HF config: {why}")
    max_pos = int(c["max_position_embeddings"])
    args = ModelArgs(
        vocab_size=c["vocab_size"], dim=c["hidden_size"], inter_dim=c["intermediate_size"],
        moe_inter_dim=c["moe_intermediate_size"], n_layers=c["num_hidden_layers"],
        n_dense_layers=c["first_k_dense_replace"], n_heads=heads, norm_eps=float(c["rms_norm_eps"]),
        max_seq_len=max_pos, n_routed_experts=c["n_routed_experts"], n_shared_experts=c["n_shared_experts"] or 0,
        q_lora_rank=c["q_lora_rank"] or 0, kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0),
        **_routing_args(model_type, c), **_rope_args(cfg, max_pos),
    )
    problems = args.check()
    if problems:
        raise ValueError("unsupported HF config: " + "; ".join(problems))
    return args


def _config_path(path: str | Path) -> Path:
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def args_from_hf_config_file(path: str | Path) -> ModelArgs:
    """`args_from_hf_config` of a config.json file, or of the config.json inside a checkpoint directory."""
    file = _config_path(path)
    if not file.is_file():
        raise ValueError(f"HF config not found: {file}")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"HF config {file} is not valid JSON: {e}") from None
    return args_from_hf_config(cfg)


def _hf_family(args: ModelArgs) -> str:
    """The transformers model type that runs `args` exactly: V3 for sigmoid scores, V2 for softmax."""
    return "deepseek_v3" if args.score_func == "sigmoid" else "deepseek_v2"


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    aliases = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    resolved = aliases.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in _DTYPE_NAMES:
        raise ValueError(f"unsupported export dtype {dtype!r} (supported: float32, bfloat16)")
    return resolved


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype | str = torch.float32) -> dict:
    """A config.json dict for `args` that transformers 5.17 loads as DeepseekV3Config (sigmoid routing) or
    DeepseekV2Config (softmax routing). Raises ValueError for args neither HF family can express."""
    family = _hf_family(args)
    grouped = args.n_expert_groups > 1
    if family == "deepseek_v3":
        if grouped and args.group_score_func != "top2_sum":
            raise ValueError("cannot export: sigmoid routing with group_score_func 'max' has no HF equivalent")
        routing = dict(n_group=args.n_expert_groups, topk_group=args.n_limited_groups, topk_method="noaux_tc",
                       scoring_func="sigmoid", norm_topk_prob=args.route_norm,
                       routed_scaling_factor=args.route_scale, rope_interleave=True)
    else:
        if grouped and args.group_score_func != "max":
            raise ValueError("cannot export: softmax routing with top2_sum group scores has no HF equivalent")
        if args.route_norm and args.route_scale != 1.0:
            raise ValueError("cannot export: DeepSeek-V2 configs cannot both normalise and scale the top-k weights")
        routing = dict(n_group=args.n_expert_groups if grouped else None,
                       topk_group=args.n_limited_groups if grouped else None,
                       topk_method="group_limited_greedy" if grouped else "greedy", scoring_func="softmax",
                       norm_topk_prob=args.route_norm, routed_scaling_factor=args.route_scale)
    rope: dict = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn_enabled:
        rope.update(rope_type="yarn", factor=args.rope_factor, original_max_position_embeddings=args.original_seq_len,
                    beta_fast=args.beta_fast, beta_slow=args.beta_slow, mscale=args.mscale,
                    mscale_all_dim=args.mscale)
        if not args.mscale:
            rope["attention_factor"] = 1.0  # without mscale fields transformers would scale cos/sin
    arch = "DeepseekV3ForCausalLM" if family == "deepseek_v3" else "DeepseekV2ForCausalLM"
    return dict(
        architectures=[arch], model_type=family, torch_dtype=_DTYPE_NAMES[_as_dtype(dtype)],
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.inter_dim,
        moe_intermediate_size=args.moe_inter_dim, num_hidden_layers=args.n_layers,
        first_k_dense_replace=args.n_dense_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads, rms_norm_eps=args.norm_eps, q_lora_rank=args.q_lora_rank or None,
        kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim, n_routed_experts=args.n_routed_experts,
        n_shared_experts=args.n_shared_experts, num_experts_per_tok=args.n_activated_experts, **routing,
        max_position_embeddings=args.max_seq_len, rope_parameters=rope, hidden_act="silu",
        attention_bias=False, tie_word_embeddings=False, num_nextn_predict_layers=args.num_mtp_layers,
    )

