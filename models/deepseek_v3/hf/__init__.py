"""Hugging Face interop: config.json <-> ModelArgs, hub key names <-> our FQNs, streaming import, sharded export.

One concern per module, each importing only the ones above it:
  * `fp8.py`: FP8 block dequantization of DeepSeek-V3's own checkpoints;
  * `config.py`: the config mapping (V3 and V2 / V2-Lite), both ways;
  * `keys.py`: the key map, the keys an import skips, the shapes our tensors must have;
  * `state_dict.py`: the in-memory adapters (`to_hf`, `from_hf`) and the sink the importers write through;
  * `io.py`: safetensors checkpoint directories: `compare_checkpoint`, the streaming importer (`load_hf_weights`,
    `read_hf_state_dict`, `load_hf_pretrained`) and the exporter (`save_hf_checkpoint`).
Names with a leading underscore are shared between these modules only; this package exposes what other code calls
(the trainer reaches it as the model spec's `checkpoints.hf`).

Conventions of the hub checkpoints this follows:
  * routed experts are stored per expert (`mlp.experts.{j}.{gate,up,down}_proj.weight`), ours are stacked [E, ...];
  * multi-token-prediction depth k is hub layer `num_hidden_layers + k` (`enorm`, `hnorm`, `eh_proj`,
    `shared_head.norm`, a full decoder layer, and copies of the embedding / output head);
  * DeepSeek-V3's own release stores linear weights as float8_e4m3fn with `<name>_scale_inv` 128x128 block scales.

Only the Python standard library, torch and safetensors are needed: transformers is not imported here.
"""

from .config import args_from_hf_config, args_from_hf_config_file, hf_config_from_args
from .fp8 import dequantize_fp8
from .io import (
    INDEX_FILE,
    compare_checkpoint,
    detect_mtp_layers,
    load_hf_pretrained,
    load_hf_weights,
    read_hf_state_dict,
    save_hf_checkpoint,
)
from .keys import expected_shapes
from .state_dict import check_exportable_bias, exported_bias_fqns, from_hf, to_hf

__all__ = [
    "INDEX_FILE",
    "args_from_hf_config",
    "args_from_hf_config_file",
    "check_exportable_bias",
    "compare_checkpoint",
    "dequantize_fp8",
    "detect_mtp_layers",
    "exported_bias_fqns",
    "expected_shapes",
    "from_hf",
    "hf_config_from_args",
    "load_hf_pretrained",
    "load_hf_weights",
    "read_hf_state_dict",
    "save_hf_checkpoint",
    "to_hf",
]
