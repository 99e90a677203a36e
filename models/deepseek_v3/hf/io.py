"""Safetensors checkpoint directories: the shard layout (`checkpoint_files`), the preflight comparison against a
model (`compare_checkpoint`), the streaming importer (`load_hf_weights`, `read_hf_state_dict`,
`load_hf_pretrained`) and the sharded exporter (`save_hf_checkpoint`), each with an optional progress bar over shards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..args import ModelArgs
from ..model import DeepSeekV3Model
from .config import _as_dtype, args_from_hf_config_file, hf_config_from_args
from .fp8 import _dequantized
from .keys import _not_a_weight, _slot_shape, expected_shapes, hf_key_map
from .state_dict import _Sink, to_hf

INDEX_FILE = "model.safetensors.index.json"


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



# ----------------------------------------------------------------------------------------------- streaming import

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
