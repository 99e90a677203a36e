"""The `[fp8]` section, which modules of a model's blocks it selects, and its checks against those blocks.

Selection is by module name (the rule of `core.names`), inside the blocks a model's parallelize plan hands in:
the eligible modules are plain linears and grouped-experts modules that offer the quantized-GEMM hook
(`core.quantization.QUANTIZED_MM`); the router's fp32 gate, norms, the attention core, the embedding and the head
never convert. The entry "default" of `modules` and `exclude_modules` stands for the model's own lists
(`core.names.ModuleDefaults`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from core.config import option
from core.names import DEFAULT, ModuleDefaults, covered_by_any, covers, resolve
from core.quantization import QUANTIZED_MM
from quantization.fp8.kernels import KERNEL_MODES
from quantization.fp8.quantize import BLOCK, ROWWISE_ALIGN

__all__ = ["RECIPES", "Fp8Section", "Fp8Selection", "fp8_block_modules", "fp8_config_problem", "fp8_selection",
           "selected_modules"]

RECIPES = ("none", "rowwise", "blockwise")


@dataclass
class Fp8Section:
    """FP8 compute for the linears and routed experts of the transformer blocks (docs/fp8.md)."""

    recipe: str = option("none", choices=list(RECIPES))
    """e4m3 inputs for every GEMM of the selected modules: blockwise (DeepSeek-V3: 1x128 activation tiles,
    128x128 weight blocks) or rowwise (one scale per row; linears via torchao); none = high precision."""
    modules: list[str] = option([DEFAULT])
    """Modules inside the blocks whose linears (and grouped experts) convert: names or dotted parts of their
    block-relative names (e.g. attention, wo, moe.experts); "default" = the model's list (DeepSeek-V3:
    attention, feed_forward, moe.experts, moe.shared_experts). Router gate, norms, attention core, embedding and
    output head always stay high precision."""
    exclude_modules: list[str] = option([DEFAULT])
    """Modules left out of modules, same naming; "default" = the model's list (DeepSeek-V3: attention.wkv_a, whose
    output, kv_lora_rank + qk_rope_head_dim = 576, is not a multiple of 128); [] excludes nothing."""
    kernels: str = option("auto", choices=list(KERNEL_MODES))
    """Which kernels run the FP8 GEMMs: auto = real FP8 GEMMs where the device has them (CUDA sm90: scaled_mm,
    _scaled_grouped_mm, DeepGEMM; rowwise linears torchao's), the emulation elsewhere; emulated = the emulation
    everywhere (quantise, dequantise, multiply in the compute dtype: the reference). The log says which run."""
    dispatch: bool = True
    """With the blockwise recipe and FP8 routed experts, expert parallelism sends the experts' inputs as e4m3 with
    one scale per 1x128 tile, as DeepSeek-V3 does, where the comm backend supports it (both built-in backends do;
    the log says whether it does; combine and the backward stay in the compute dtype): about half the bytes of
    bf16, and the experts see the same values."""
    all_gather: bool = True
    """With the blockwise recipe and FSDP, each rank quantises its shard of the FP8 modules' weights and FSDP
    gathers the e4m3 blocks (1 byte per element and a scale per 128x128 block, not the param dtype's 2 or 4), which
    the GEMMs take as they are: the same values as gathering first. Only weights whose shard holds whole blocks; the
    log says how many. false = gather in the param dtype and quantise on every rank."""

    @property
    def dispatch_tile(self) -> int:
        """Width of the 1 x n tiles FP8 dispatch quantises the routed experts' inputs in (the blockwise recipe's
        activation tiles) when `dispatch` applies, else 0."""
        return BLOCK if self.recipe == "blockwise" and self.dispatch else 0


@dataclass(frozen=True)
class Fp8Selection:
    """The `[fp8]` section resolved against a model's defaults: the recipe and the concrete name lists."""

    recipe: str
    modules: tuple[str, ...]
    exclude_modules: tuple[str, ...]
    kernels: str = "auto"

    def selects(self, fqn: str) -> bool:
        """Whether the module with block-relative name `fqn` converts (when the recipe is not none)."""
        return covered_by_any(fqn, self.modules) and not covered_by_any(fqn, self.exclude_modules)


def fp8_selection(fp8_cfg: Fp8Section, defaults: ModuleDefaults) -> Fp8Selection:
    """The section with its "default" entries replaced by the model's lists."""
    return Fp8Selection(fp8_cfg.recipe, tuple(resolve(fp8_cfg.modules, defaults.fp8_modules)),
                        tuple(resolve(fp8_cfg.exclude_modules, defaults.fp8_exclude_modules)), fp8_cfg.kernels)


def _eligible(module: nn.Module) -> bool:
    """A plain linear (not the router's Fp32Linear) or a grouped-experts module that supports FP8."""
    return type(module) is nn.Linear or hasattr(module, QUANTIZED_MM)


def fp8_block_modules(blocks: Iterable[nn.Module]) -> dict[str, nn.Module]:
    """Block-relative FQN -> one module with that name, of every FP8-eligible module in `blocks`."""
    found: dict[str, nn.Module] = {}
    for block in blocks:
        for fqn, module in block.named_modules():
            if fqn and _eligible(module):
                found.setdefault(fqn, module)
    return found


def _gemm_dims(module: nn.Module) -> tuple[int, ...]:
    """The dims a tile must divide: a linear's (in, out); a grouped-experts module's weights [E, out, in] give
    (out, in) of each of them."""
    if isinstance(module, nn.Linear):
        return (module.in_features, module.out_features)
    return tuple(d for p in module.parameters(recurse=False) for d in p.shape[1:])


def fp8_config_problem(selection: Fp8Selection, blocks: Iterable[nn.Module],
                       vocabulary: Iterable[nn.Module] | None = None) -> tuple[str, str, str] | None:
    """The first mistake of a resolved `[fp8]` section for a model with these blocks, as (key, problem, allowed).

    Names in `modules` and `exclude_modules` must each cover an FP8-eligible module of the `vocabulary` blocks
    (default: `blocks`; a model family passes one block of every kind it can build, so that its default names
    stay valid for a model without, say, dense layers). With a recipe on, every selected module of `blocks` must
    have dims that are multiples of its tile (128 for blockwise, 16 for rowwise), and rowwise linears need torchao
    (unless `kernels` is emulated).
    """
    blocks = list(blocks)
    known = fp8_block_modules(blocks if vocabulary is None else vocabulary)
    for key in ("modules", "exclude_modules"):
        for name in getattr(selection, key):
            if not any(covers(fqn, name) for fqn in known):
                return (f"fp8.{key}", f"{name!r} matches no linear or grouped experts inside the blocks (only "
                        "those convert: the embedding, the head, norms and fp32 linears stay high precision)",
                        f"names or dotted parts of: {', '.join(known)}")
    if selection.recipe == "none":
        return None
    align = BLOCK if selection.recipe == "blockwise" else ROWWISE_ALIGN
    selected = selected_modules(selection, blocks)
    for fqn, module in selected.items():
        if any(d % align for d in _gemm_dims(module)):
            return ("fp8.modules", f"{fqn} has dims {_gemm_dims(module)}, not multiples of {align} as the "
                    f"{selection.recipe} recipe needs", f"add {fqn!r} to fp8.exclude_modules, or recipe none")
    needs_torchao = selection.recipe == "rowwise" and selection.kernels == "auto" and \
        any(isinstance(m, nn.Linear) for m in selected.values())
    if needs_torchao and importlib.util.find_spec("torchao") is None:
        return ("fp8.recipe", "rowwise linears run on torchao's Float8Linear, and torchao is not installed",
                "none or blockwise, fp8.kernels = emulated, or pip install '.[fp8]'")
    return None


def selected_modules(selection: Fp8Selection, blocks: Iterable[nn.Module]) -> dict[str, nn.Module]:
    """Block-relative FQN -> module of every eligible module of `blocks` the selection converts."""
    return {fqn: m for fqn, m in fp8_block_modules(blocks).items() if selection.selects(fqn)}

