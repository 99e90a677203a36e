"""DeepSeek-V3's pipeline split: its units, and the stage maker that keeps only some of them.

Units in forward order: `tok_embeddings` (first stage), `layers.0` ... `layers.{L-1}`, and `norm output` (last
stage). A stage is a deep copy of the (meta-device) model with the other units removed (`tok_embeddings`, `norm`,
`output` set to None, blocks deleted from the `layers` dict), so parameter names stay those of the full model and
`DeepSeekV3Model.forward` skips what the stage does not hold.
"""

from __future__ import annotations

import copy

from parallelisms.pipeline import SplitUnits

from .args import ModelArgs
from .model import DeepSeekV3Model


def split_units(args: ModelArgs) -> SplitUnits:
    """The units `parallelisms.pipeline` balances over the stages."""
    return SplitUnits(first=("tok_embeddings",), layers=tuple((f"layers.{i}",) for i in range(args.n_layers)),
                      last=("norm", "output"))


def keep_stage(model: DeepSeekV3Model, keep: list[str]) -> DeepSeekV3Model:
    """A copy of the (meta) model holding only the modules named in `keep`."""
    part = copy.deepcopy(model)
    if "tok_embeddings" not in keep:
        part.tok_embeddings = None
    for layer_id in list(part.layers.keys()):
        if f"layers.{layer_id}" not in keep:
            del part.layers[layer_id]
    if "norm" not in keep:
        part.norm = None
    if "output" not in keep:
        part.output = None
    return part
