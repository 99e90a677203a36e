"""The state-dict key map: hub key names <-> our FQNs (with the expert slot of the stacked experts), the keys an
import skips, and the shapes our tensors must have."""

from __future__ import annotations

import re
from typing import Iterator

import torch

from ..args import ModelArgs
from ..model import DeepSeekV3Model
from .config import _hf_family


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



def _slot_shape(target: KeyTarget, expected: dict[str, torch.Size]) -> tuple[int, ...]:
    """The shape a hub tensor must have for its place among our tensors (one expert of a stacked tensor)."""
    fqn, slot = target
    return tuple(expected[fqn] if slot is None else expected[fqn][1:])


def expected_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Shapes of our persistent state (parameters and expert_bias) for `args`, from a model on the meta device."""
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    return {fqn: t.shape for fqn, t in model.state_dict().items()}

