"""Small DeepSeek-V3 shapes for tests of the trainer (checkpoints, layouts, leaks), where the debug model's size
only costs time and disk: its 33M parameters make a 378 MiB checkpoint with the Adam state, SMALL's 1.9M one of
22 MiB and TINY's 0.36M one of 4 MiB."""

import json
import os
import tempfile

from models.deepseek_v3.args import FLAVORS, ModelArgs
from models.deepseek_v3.hf import hf_config_from_args

#: The debug model's shapes cut to width 128 (the FP8 tile) and 3 layers (1 dense, 2 MoE, 8 experts, MLA): every
#: piece of a block is there, two pipeline stages get a layer each, and the FSDP/EP traffic that dominates a step on
#: gloo ranks is a tenth of the debug model's.
SMALL = FLAVORS["debugmodel"].replace(n_layers=3, dim=128, inter_dim=256, moe_inter_dim=128, n_heads=4,
                                      kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)

#: 2 layers (1 dense, 1 MoE) at width 64: builds, trains a step and saves in about a second.
TINY = FLAVORS["debugmodel"].replace(n_layers=2, dim=64, inter_dim=128, moe_inter_dim=32, n_heads=2,
                                     kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def hf_config_file(args: ModelArgs, folder=None) -> str:
    """Write `args` as an HF config.json for `--model.hf_config_path` and return its path: in `folder`, else in a
    new temporary folder (the test session removes its temporary files, see conftest.py)."""
    folder = str(folder) if folder is not None else tempfile.mkdtemp(prefix="model_config_")
    path = os.path.join(folder, f"config_{len([n for n in os.listdir(folder) if n.startswith('config_')])}.json")
    with open(path, "w") as f:
        json.dump(hf_config_from_args(args), f)
    return path
