"""In-memory conversion between our state dict and hub keys (`to_hf`, `from_hf`), the export's bias check, and
`_Sink`, which writes hub tensors into our tensors one at a time (the streaming importer in `io.py` uses it too)."""

from __future__ import annotations

import torch

from ..args import ModelArgs
from .fp8 import _dequantized
from .keys import _ignored, _implied_zeros, _MTP_SHARED_COPIES, _slot_shape, expected_shapes, hf_key_map


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

