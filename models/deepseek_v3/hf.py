"""Hugging Face interop: config.json <-> ModelArgs, hub key names <-> our FQNs, streaming import, sharded export.

Read top to bottom: the config mapping (V3 and V2 / V2-Lite), the key map, the in-memory adapters (`to_hf`,
`from_hf`), FP8 block dequantization, the streaming importer (`load_hf_weights`, `read_hf_state_dict`,
`load_hf_pretrained`) and the exporter (`save_hf_checkpoint`).

Conventions of the hub checkpoints this follows:
  * routed experts are stored per expert (`mlp.experts.{j}.{gate,up,down}_proj.weight`), ours are stacked [E, ...];
  * multi-token-prediction depth k is hub layer `num_hidden_layers + k` (`enorm`, `hnorm`, `eh_proj`,
    `shared_head.norm`, a full decoder layer, and copies of the embedding / output head);
  * DeepSeek-V3's own release stores linear weights as float8_e4m3fn with `<name>_scale_inv` 128x128 block scales.

Only the Python standard library, torch and safetensors are needed: transformers is not imported here.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from core.quantization import FP8_TILE

from .args import ModelArgs
from .model import DeepSeekV3Model

FP8_BLOCK = FP8_TILE  # DeepSeek-V3's FP8 checkpoints scale each 128x128 block of a weight by one fp32 factor
INDEX_FILE = "model.safetensors.index.json"

# ----------------------------------------------------------------------------------------------- config mapping

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


# ----------------------------------------------------------------------------------------------- key map

_ATTN = [("self_attn.kv_a_proj_with_mqa", "attention.wkv_a"), ("self_attn.kv_a_layernorm", "attention.kv_norm"),
         ("self_attn.kv_b_proj", "attention.wkv_b"), ("self_attn.o_proj", "attention.wo"),
         ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm")]
_Q_LORA = [("self_attn.q_a_proj", "attention.wq_a"), ("self_attn.q_a_layernorm", "attention.q_norm"),
           ("self_attn.q_b_proj", "attention.wq_b")]
_SWIGLU = [("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")]
_MTP = [("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("shared_head.norm", "norm")]
_MTP_SHARED_COPIES = {"shared_head.head.weight": "output.weight", "embed_tokens.weight": "tok_embeddings.weight"}

KeyTarget = tuple[str, int | None]  # (our FQN, expert slot in the stacked tensor or None)


def _block_keys(hf_prefix: str, ours: str, layer_id: int, args: ModelArgs) -> Iterator[tuple[str, KeyTarget]]:
    pairs = list(_ATTN)
    pairs += _Q_LORA if args.q_lora_rank else [("self_attn.q_proj", "attention.wq")]
    if layer_id < args.n_dense_layers:
        pairs += [(f"mlp.{h}", f"feed_forward.{o}") for h, o in _SWIGLU]
    else:
        pairs.append(("mlp.gate", "moe.router.gate"))
        if args.n_shared_experts:
            pairs += [(f"mlp.shared_experts.{h}", f"moe.shared_experts.{o}") for h, o in _SWIGLU]
    for h, o in pairs:
        yield f"{hf_prefix}{h}.weight", (f"{ours}{o}.weight", None)
    if layer_id >= args.n_dense_layers:
        if _hf_family(args) == "deepseek_v3":
            yield f"{hf_prefix}mlp.gate.e_score_correction_bias", (f"{ours}moe.expert_bias", None)
        for j in range(args.n_routed_experts):
            for h, o in _SWIGLU:
                yield f"{hf_prefix}mlp.experts.{j}.{h}.weight", (f"{ours}moe.experts.{o}", j)


def hf_key_map(args: ModelArgs) -> dict[str, KeyTarget]:
    """Every hub key of a checkpoint for `args` -> (our FQN, expert slot or None), in checkpoint order.

    The MTP layers' copies of the embedding and output head are not listed: they are the shared tensors.
    """
    keys: dict[str, KeyTarget] = {"model.embed_tokens.weight": ("tok_embeddings.weight", None)}
    for i in range(args.n_layers):
        keys.update(_block_keys(f"model.layers.{i}.", f"layers.{i}.", i, args))
    for k in range(args.num_mtp_layers):
        hf_prefix, ours = f"model.layers.{args.n_layers + k}.", f"mtp.layers.{k}."
        keys.update((f"{hf_prefix}{h}.weight", (f"{ours}{o}.weight", None)) for h, o in _MTP)
        keys.update(_block_keys(hf_prefix, f"{ours}block.", args.n_layers + k, args))
    keys["model.norm.weight"] = ("norm.weight", None)
    keys["lm_head.weight"] = ("output.weight", None)
    return keys


def _implied_zeros(args: ModelArgs, expected: dict[str, torch.Size]) -> list[str]:
    """Our tensors HF does not store: V2 has no selection bias, so the imported bias is zero."""
    if _hf_family(args) == "deepseek_v3":
        return []
    return [fqn for fqn in expected if fqn.endswith("moe.expert_bias")]


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _not_a_weight(hf_key: str, args: ModelArgs) -> bool:
    """Hub keys that hold no weight of their own: RoPE caches, the empty shared-expert weights HF keeps when
    n_shared_experts is 0, and the MTP layers' copies of the shared embedding and head."""
    if hf_key.endswith("rotary_emb.inv_freq") or (not args.n_shared_experts and ".mlp.shared_experts." in hf_key):
        return True
    match = _LAYER_RE.match(hf_key)
    return (match is not None and args.n_layers <= int(match.group(1)) < args.n_layers + args.num_mtp_layers
            and match.group(2) in _MTP_SHARED_COPIES)


def _beyond_the_model(hf_key: str, args: ModelArgs) -> bool:
    """Layers past the model's layers and MTP layers (a deeper checkpoint, or MTP layers the model leaves out)."""
    match = _LAYER_RE.match(hf_key)
    return match is not None and int(match.group(1)) >= args.n_layers + args.num_mtp_layers


def _ignored(hf_key: str, args: ModelArgs) -> bool:
    """Hub keys an import skips: `_not_a_weight`, and layers `_beyond_the_model` (`load_hf_pretrained` imports
    the causal LM of a checkpoint with MTP layers this way; the trainer refuses such a checkpoint in preflight
    unless `checkpoint.allow_partial_load`, see `compare_checkpoint`)."""
    return _not_a_weight(hf_key, args) or _beyond_the_model(hf_key, args)


def compare_checkpoint(path: str | Path, args: ModelArgs
                       ) -> tuple[dict[str, str], list[str], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """What a checkpoint directory holds against what a model of `args` needs, from its index and shard headers:
    ({hub key: our state_dict key} of the weights the checkpoint lacks, [hub keys of weights the model has no
    place for], {hub key: (its shape in the checkpoint, the model's)} of the weights both have in other shapes).
    FP8 scales, RoPE caches and the MTP layers' copies of shared tensors are none of them. ValueError if the
    directory or a shard is missing."""
    _, key_to_file = checkpoint_files(path)
    key_map = hf_key_map(args)
    missing = {key: fqn for key, (fqn, _) in key_map.items() if key not in key_to_file}
    extra = [key for key in key_to_file
             if key not in key_map and not key.endswith("_scale_inv") and not _not_a_weight(key, args)]
    expected = expected_shapes(args)
    reshaped = {}
    for file in sorted({file for key, file in key_to_file.items() if key in key_map}):
        with safe_open(file, framework="pt") as f:  # reads the header only
            for key in f.keys():
                if key in key_map:
                    shape, wanted = tuple(f.get_slice(key).get_shape()), _slot_shape(key_map[key], expected)
                    if shape != wanted:
                        reshaped[key] = (shape, wanted)
    return missing, extra, {key: reshaped[key] for key in key_map if key in reshaped}  # in the model's order


def _slot_shape(target: KeyTarget, expected: dict[str, torch.Size]) -> tuple[int, ...]:
    """The shape a hub tensor must have for its place among our tensors (one expert of a stacked tensor)."""
    fqn, slot = target
    return tuple(expected[fqn] if slot is None else expected[fqn][1:])


def expected_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Shapes of our persistent state (parameters and expert_bias) for `args`, from a model on the meta device."""
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    return {fqn: t.shape for fqn, t in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------- in-memory adapters

def exported_bias_fqns(args: ModelArgs) -> list[str]:
    """Our expert-bias FQNs that an export must find all zero: those of a softmax-routing model (deepseek_v2)."""
    return _implied_zeros(args, expected_shapes(args))


def check_exportable_bias(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """ValueError, naming the way out, when `args` exports as deepseek_v2 and an expert bias is not zero.

    transformers' DeepseekV3 router always scores with sigmoid and DeepseekV2 has no selection bias, so no HF class
    runs softmax scores with a bias: writing either would be another model.
    """
    for fqn in exported_bias_fqns(args):
        if fqn in state_dict and state_dict[fqn].count_nonzero():
            raise ValueError(
                f"cannot export {fqn}: it is not zero and the model routes with softmax scores; transformers' "
                "DeepseekV3 scores only with sigmoid and DeepseekV2 has no expert selection bias, so no HF class "
                "runs this model. Way out: train with moe.load_balance_coeff = 0 (the bias stays zero; exports as "
                "deepseek_v2), or with sigmoid routing (model.hf_config_path to a deepseek_v3 config.json; exports "
                "as deepseek_v3 with its bias)")


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> hub keys, with per-expert views of the stacked experts and the MTP layers' copies of the
    embedding and head. Tensors are views of the input (no copy). ValueError on a missing or mis-shaped tensor."""
    expected = expected_shapes(args)
    for fqn, shape in expected.items():
        if fqn not in state_dict:
            raise ValueError(f"state dict has no {fqn}")
        if state_dict[fqn].shape != shape:
            raise ValueError(f"{fqn}: shape {list(state_dict[fqn].shape)}, expected {list(shape)} for these args")
    check_exportable_bias(state_dict, args)
    out = {}
    for hf_key, (fqn, slot) in hf_key_map(args).items():
        out[hf_key] = state_dict[fqn] if slot is None else state_dict[fqn][slot]
    for k in range(args.num_mtp_layers):
        for rest, fqn in _MTP_SHARED_COPIES.items():
            out[f"model.layers.{args.n_layers + k}.{rest}"] = state_dict[fqn]
    return out


class _Sink:
    """Receives hub tensors one at a time and writes each into its place among our tensors.

    `targets` maps our FQNs to preallocated tensors (a model's parameters); with `targets=None` each tensor is
    allocated on first write in `dtype` (or the incoming dtype), the expert_bias always in fp32. `partial` skips
    keys the model has no place for or holds in another shape, and leaves out the tensors the checkpoint lacks (a
    partial load).
    """

    def __init__(self, args: ModelArgs, targets: dict[str, torch.Tensor] | None = None,
                 dtype: torch.dtype | None = None, partial: bool = False):
        self.args = args
        self.partial = partial
        self.key_map = hf_key_map(args)
        self.expected = expected_shapes(args)
        self.targets = {} if targets is None else targets
        self.allocate = targets is None
        self.dtype = dtype
        self.done: set[str] = set()

    def wants(self, hf_key: str) -> bool:
        """True for a key to import, False for one to skip; ValueError for a key no checkpoint of args holds."""
        if hf_key in self.key_map:
            return True
        if _ignored(hf_key, self.args) or self.partial:
            return False
        raise ValueError(f"unexpected key {hf_key} for a checkpoint of these args")

    def fits(self, hf_key: str, shape: list[int]) -> bool:
        """Whether a tensor of `shape` fits the place of `hf_key`: a partial load skips one that does not (it
        keeps the model's initialisation), a full load raises ValueError."""
        wanted = _slot_shape(self.key_map[hf_key], self.expected)
        if tuple(shape) == wanted or self.partial:
            return tuple(shape) == wanted
        raise ValueError(f"{hf_key}: shape {list(shape)} in checkpoint, expected {list(wanted)}")

    @torch.no_grad()
    def write(self, hf_key: str, tensor: torch.Tensor) -> None:
        if not self.fits(hf_key, list(tensor.shape)):
            return
        fqn, slot = self.key_map[hf_key]
        if fqn not in self.targets:
            if not self.allocate:
                raise ValueError(f"target model has no {fqn}")
            dtype = torch.float32 if fqn.endswith("expert_bias") else (self.dtype or tensor.dtype)
            self.targets[fqn] = torch.empty(self.expected[fqn], dtype=dtype)
        target = self.targets[fqn] if slot is None else self.targets[fqn][slot]
        target.copy_(tensor)
        self.done.add(hf_key)

    @torch.no_grad()
    def finish(self, source: str) -> dict[str, torch.Tensor]:
        missing = [k for k in self.key_map if k not in self.done]
        if missing and not self.partial:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"missing key {missing[0]}{more} in {source}")
        if self.allocate:
            # a partial load leaves out a tensor the checkpoint fills only in part (some experts of a stack): the
            # rest of a fresh tensor is uninitialised memory, the model's own initialisation is not
            for fqn in {self.key_map[k][0] for k in missing}:
                self.targets.pop(fqn, None)
        for fqn in _implied_zeros(self.args, self.expected):
            if fqn in self.targets:
                self.targets[fqn].zero_()
            elif self.allocate:
                self.targets[fqn] = torch.zeros(self.expected[fqn], dtype=torch.float32)
        return self.targets


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hub keys -> our state dict: experts stacked into [E, ...], FP8 weights dequantized, MTP copies of shared
    tensors and extra MTP layers skipped. ValueError on a missing, unexpected or mis-shaped key."""
    def scale_of(hf_key: str) -> torch.Tensor:
        if hf_key + "_scale_inv" not in hf_state_dict:
            raise ValueError(f"{hf_key} is float8 but {hf_key}_scale_inv is missing")
        return hf_state_dict[hf_key + "_scale_inv"]

    sink = _Sink(args)
    for hf_key, tensor in hf_state_dict.items():
        if hf_key.endswith("_scale_inv") or not sink.wants(hf_key):
            continue
        sink.write(hf_key, _dequantized(hf_key, tensor, scale_of))
    return sink.finish("the HF state dict")


# ----------------------------------------------------------------------------------------------- FP8

def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp32 weight of a float8_e4m3fn [M, N] tensor and its [ceil(M/block), ceil(N/block)] fp32 block scales.

    Each block x block tile is multiplied by its scale; the last row / column of tiles may be ragged.
    """
    if weight.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {list(weight.shape)}")
    M, N = weight.shape
    Mb, Nb = -(-M // block), -(-N // block)
    if list(scale_inv.shape) != [Mb, Nb]:
        raise ValueError(f"FP8 scales of a {M}x{N} weight must be {Mb}x{Nb}, got {list(scale_inv.shape)}")
    # pad to whole tiles so one broadcast multiply covers every tile, then cut the padding off
    padded = weight.new_zeros(Mb * block, Nb * block, dtype=torch.float32)
    padded[:M, :N] = weight.float()
    padded.view(Mb, block, Nb, block).mul_(scale_inv.float()[:, None, :, None])
    return padded[:M, :N]


def _dequantized(hf_key: str, tensor: torch.Tensor, scale_of: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """`tensor`, dequantized with the block scales `scale_of(hf_key)` when it is float8_e4m3fn."""
    if tensor.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(tensor, scale_of(hf_key))
    if tensor.is_floating_point() and tensor.element_size() == 1:
        raise ValueError(f"{hf_key}: {tensor.dtype} is not supported (only float8_e4m3fn with block scales)")
    return tensor


# ----------------------------------------------------------------------------------------------- streaming import

def _progress(items: list, desc: str, enabled: bool) -> Iterable:
    """`items`, wrapped in a tqdm bar on stderr when enabled (tqdm comes with the `datasets` dependency)."""
    if not enabled:
        return items
    from tqdm import tqdm  # not a declared dependency (it comes with datasets): loaded only to draw a bar

    return tqdm(items, desc=desc, unit="shard", file=sys.stderr)


def checkpoint_files(path: str | Path) -> tuple[list[Path], dict[str, Path]]:
    """(shard files, key -> file) of a safetensors checkpoint directory, with or without an index file.

    ValueError if the directory, a shard named in the index, or every shard is missing.
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"HF checkpoint directory not found: {root}")
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"shard {file.name} named in {INDEX_FILE} is missing from {root}")
        return files, {key: root / name for key, name in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {root}")
    key_to_file = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            key_to_file.update((key, file) for key in f.keys())
    return files, key_to_file


def _stream_into(sink: _Sink, path: str | Path, progress: bool) -> dict[str, torch.Tensor]:
    """Read a checkpoint shard by shard, handing each tensor to `sink` as soon as it is read."""
    files, key_to_file = checkpoint_files(path)
    for file in _progress(files, "import", progress):
        with safe_open(file, framework="pt") as f:
            for hf_key in f.keys():
                if hf_key.endswith("_scale_inv") or not sink.wants(hf_key):
                    continue
                if not sink.fits(hf_key, f.get_slice(hf_key).get_shape()):
                    continue
                sink.write(hf_key, _dequantized(hf_key, f.get_tensor(hf_key),
                                                lambda key: _read_scale(key, key_to_file)))
    return sink.finish(str(path))


def _read_scale(hf_key: str, key_to_file: dict[str, Path]) -> torch.Tensor:
    scale_key = hf_key + "_scale_inv"
    if scale_key not in key_to_file:
        raise ValueError(f"{hf_key} is float8 but {scale_key} is not in the checkpoint")
    with safe_open(key_to_file[scale_key], framework="pt") as f:
        if scale_key not in f.keys():
            raise ValueError(f"{scale_key} is missing from {key_to_file[scale_key].name}")
        return f.get_tensor(scale_key)


def detect_mtp_layers(path: str | Path, args: ModelArgs) -> int:
    """How many of the config's `num_mtp_layers` MTP layers the checkpoint at `path` actually stores."""
    _, key_to_file = checkpoint_files(path)
    present = 0
    while present < args.num_mtp_layers and f"model.layers.{args.n_layers + present}.eh_proj.weight" in key_to_file:
        present += 1
    return present


def load_hf_weights(model: DeepSeekV3Model, path: str | Path, progress: bool = False) -> None:
    """Stream a HF checkpoint directory into `model`'s (unsharded) parameters and expert_bias, in place.

    Each tensor is copied into its parameter (experts: into their slot of the stacked tensor) as soon as it is
    read, converting dtype; FP8 weights are dequantized first. ValueError on a missing shard, a missing or
    unexpected key, or a shape mismatch.
    """
    _stream_into(_Sink(model.args, targets=model.state_dict()), path, progress)


def read_hf_state_dict(path: str | Path, args: ModelArgs, dtype: torch.dtype | None = torch.float32,
                       progress: bool = False, partial: bool = False) -> dict[str, torch.Tensor]:
    """Our state dict (FQN -> tensor in `dtype`; None keeps the checkpoint's dtype) streamed from a HF checkpoint
    directory, without building a model. `partial`: skip weights the model has no place for or holds in another
    shape, and leave out those the checkpoint lacks, instead of raising ValueError."""
    return _stream_into(_Sink(args, dtype=dtype, partial=partial), path, progress)


def load_hf_pretrained(path: str | Path, device: str | torch.device = "cpu", num_mtp_layers: int | None = 0,
                       progress: bool = False) -> DeepSeekV3Model:
    """A fp32 `DeepSeekV3Model` in eval mode from a HF checkpoint directory (config.json + safetensors shards).

    num_mtp_layers: 0 imports the causal LM only (MTP layers in the checkpoint are skipped); None takes
    `num_nextn_predict_layers` from config.json (the checkpoint must then hold those layers); an int asks for that
    many. The model is built on the meta device and materialised once, so only one copy of the weights exists.
    """
    args = args_from_hf_config_file(path)
    if num_mtp_layers is not None:
        args = args.replace(num_mtp_layers=num_mtp_layers)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=torch.device(device))  # re-creates the RoPE tables and MoE buffers
    load_hf_weights(model, path, progress=progress)
    return model.eval()


# ----------------------------------------------------------------------------------------------- export

def _shard_plan(tensors: dict[str, torch.Tensor], dtype_of: Callable[[str], torch.dtype],
                max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped into shards of at most max_shard_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * dtype_of(key).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def save_hf_checkpoint(model_or_state_dict: nn.Module | dict[str, torch.Tensor], args: ModelArgs,
                       out_dir: str | Path, max_shard_bytes: int = 4 * 2**30,
                       dtype: torch.dtype | str = torch.float32, progress: bool = False) -> Path:
    """Write a HF checkpoint directory: config.json, `model-0000i-of-0000n.safetensors` shards and
    model.safetensors.index.json. Weights are written in `dtype` (float32 or bfloat16); the expert selection
    bias stays fp32 as in the hub checkpoints. Only one shard's worth of converted tensors is alive at a time.
    Returns out_dir."""
    dtype = _as_dtype(dtype)
    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    config = hf_config_from_args(args, dtype)
    hf = to_hf(state, args)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def dtype_of(key: str) -> torch.dtype:
        return torch.float32 if key.endswith("e_score_correction_bias") else dtype

    plan = _shard_plan(hf, dtype_of, max_shard_bytes)
    weight_map, total = {}, 0
    for i, keys in enumerate(_progress(plan, "export", progress), start=1):
        name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        # copies: expert views share storage with their stacked tensor, which safetensors refuses to save
        shard = {k: hf[k].detach().to(device="cpu", dtype=dtype_of(k), copy=True).contiguous() for k in keys}
        save_file(shard, out / name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update((k, name) for k in keys)
        del shard
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
