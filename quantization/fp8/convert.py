"""`apply_fp8`: convert the selected modules of the blocks a model's parallelize plan hands in.

It runs in the plan after expert parallelism and before activation checkpointing, compile and FSDP. Linears are
replaced by an FP8 linear holding the same weight Parameter (blockwise: `gemms.Fp8Linear`; rowwise: torchao's
`Float8Linear`, an optional dependency, where `torch._scaled_mm` runs, else `gemms.Fp8Linear`'s emulation); grouped
experts get an `Fp8GroupedMM` as their quantized grouped GEMM (`core.quantization`). The kernels are chosen for
this machine (`kernels.Platform.detect`: CUDA when present, as the trainer's device) and logged in one line.
Parameters keep their objects and names, so checkpoints hold the same high-precision master weights whatever the
recipe (a run can switch recipes across a resume).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch
from torch import nn

from core.quantization import QUANTIZED_MM
from quantization.fp8.config import Fp8Selection, selected_modules
from quantization.fp8.fsdp_all_gather import gather_as_blocks
from quantization.fp8.gemms import Fp8GroupedMM, Fp8Linear
from quantization.fp8.kernels import TORCHAO_LINEAR, Platform, describe, rowwise_linear_kernel

__all__ = ["apply_fp8", "apply_fp8_all_gather"]

logger = logging.getLogger(__name__)


@functools.cache
def _torchao_rowwise_config():
    from torchao.float8 import Float8LinearConfig  # optional dependency: only the rowwise recipe needs it

    return Float8LinearConfig.from_recipe_name("rowwise")


def _convert_linear(linear: nn.Linear, recipe: str, kernels: str = "auto", platform: Platform | None = None
                    ) -> nn.Module:
    platform = Platform.detect() if platform is None else platform
    if recipe == "blockwise" or kernels != "auto" or rowwise_linear_kernel(platform) != TORCHAO_LINEAR:
        return Fp8Linear.from_linear(linear, recipe, kernels, platform)
    from torchao.float8.float8_linear import Float8Linear  # optional dependency, see _torchao_rowwise_config

    return Float8Linear.from_float(linear, config=_torchao_rowwise_config())


def apply_fp8(blocks: Mapping[str, nn.Module], selection: Fp8Selection, platform: Platform | None = None
              ) -> list[str]:
    """Convert the modules `selection` selects in each block of `blocks` ({name in the model: block}) in place, with
    kernels chosen for `platform` (default: this machine).

    Returns the converted modules' names (`<block name>.<block-relative FQN>`); [] for recipe none.
    """
    if selection.recipe == "none":
        return []
    platform = Platform.detect() if platform is None else platform
    converted = []
    for block_name, block in blocks.items():
        for fqn, module in selected_modules(selection, [block]).items():
            if isinstance(module, nn.Linear):
                parent_name, _, leaf = fqn.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                parent.register_module(leaf, _convert_linear(module, selection.recipe, selection.kernels, platform))
            else:
                setattr(module, QUANTIZED_MM, Fp8GroupedMM(selection.recipe, selection.kernels, platform))
            converted.append(f"{block_name}.{fqn}")
    logger.info("fp8 %s: %d modules converted (%s, ...)", selection.recipe, len(converted),
                ", ".join(converted[:4]))
    if converted:
        logger.info(describe(platform, selection.recipe, selection.kernels))
    return converted


def apply_fp8_all_gather(root: nn.Module, dense_shard: int, experts_shard: int, experts_dtype: torch.dtype | None
                         ) -> int:
    """Before `fully_shard`: let FSDP gather the weights of `root`'s blockwise FP8 modules as e4m3 blocks
    (`fsdp_all_gather`), where each rank's shard holds whole blocks: linears sharded over `dense_shard` ranks,
    routed experts over `experts_shard` (quantised from `experts_dtype`, the dtype they compute in where it is not
    FSDP's param dtype; None: the param dtype). Returns how many weights it converted, of how many FP8 weights, in
    one log line."""
    converted = total = 0
    for module in root.modules():
        if isinstance(module, Fp8Linear):
            names, shard, dtype = (["weight"] if module.recipe == "blockwise" else []), dense_shard, None
        elif isinstance(mm := getattr(module, QUANTIZED_MM, None), Fp8GroupedMM):
            names = [n for n, w in module.named_parameters(recurse=False) if mm.takes_blocks(w)]
            shard, dtype = experts_shard, experts_dtype
        else:
            continue
        total += len(names)
        converted += sum(gather_as_blocks(module, name, shard, dtype) for name in names)
    if total:
        logger.info("fp8 all-gather: FSDP gathers %d of %d blockwise FP8 weights as e4m3 blocks (the others: "
                    "sharded over one rank, or their shards split 128x128 blocks)", converted, total)
    return converted
