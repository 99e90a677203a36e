"""Which kernel runs each FP8 GEMM: a pure function of a `Platform` (device, compute capability, what the torch
build and the optional dependencies offer), the compute dtype and the GEMM's shape, so that the choice is tested
without a GPU; `Platform.detect` reads the running machine.

    GEMM kind                    kernel                                     when
    linear, rowwise              torchao's Float8Linear (torch._scaled_mm)  CUDA sm89+, or a CPU whose torch takes
                                                                            rowwise scales (2.13; not 2.11); torchao
    linear, blockwise fwd/dgrad  scaled_mm BlockWise1x128 x BlockWise128x128  CUDA sm90, bf16, dims % 128 == 0
    linear, blockwise wgrad      scaled_mm BlockWise1x128 x BlockWise1x128  the same, and tokens a multiple of 128
    grouped experts, rowwise     torch._scaled_grouped_mm, rowwise scales   CUDA sm90, bf16, dims % 16 == 0
    grouped experts, blockwise   DeepGEMM (through torchao's MoE wrapper)   CUDA sm90, deep_gemm importable, bf16
                                 scaled_mm per expert (1x128 x 128x128)     CUDA sm90 without DeepGEMM, bf16
    anything else                emulated: quantise, dequantise, multiply in the compute dtype (`gemms.py`)

Why these (docs/fp8.md, "Kernels"): cuBLAS' blockwise scaled GEMMs (torch >= 2.9) run on sm90 only, and torch's
grouped FP8 GEMM is taken as sm90-only too until a Blackwell GPU has run it. That one takes rowwise scales only, so
blockwise experts need DeepGEMM or one scaled_mm per expert (which reads the group offsets on the host: one sync
per grouped GEMM). The emulation is the reference and the CPU path; its e4m3 operands and the real kernels' are the
same bits (`quantize.quantize_tiles`), except DeepGEMM's, whose quantisation is torchao's (scales amax / 448, not
powers of two).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from dataclasses import dataclass

import torch

from quantization.fp8.quantize import BLOCK, ROWWISE_ALIGN

__all__ = ["DEEPGEMM", "EMULATED", "KERNEL_MODES", "LinearKernels", "PER_EXPERT", "Platform", "ROWWISE_GROUPED",
           "SCALED_MM_BLOCKS", "SCALED_MM_TILES", "TORCHAO_LINEAR", "blockwise_linear_kernels", "describe",
           "grouped_kernel", "rowwise_linear_kernel"]

EMULATED = "emulated"
TORCHAO_LINEAR = "torchao Float8Linear"
SCALED_MM_BLOCKS = "scaled_mm BlockWise1x128 x BlockWise128x128"
SCALED_MM_TILES = "scaled_mm BlockWise1x128 x BlockWise1x128"
ROWWISE_GROUPED = "_scaled_grouped_mm rowwise"
DEEPGEMM = "DeepGEMM (torchao)"
PER_EXPERT = "scaled_mm per expert"
#: `fp8.kernels`: auto = the choice of this module; emulated = the emulation everywhere (the reference)
KERNEL_MODES = ("auto", EMULATED)


@dataclass(frozen=True)
class Platform:
    """What decides the kernels: the device and what this torch build and the optional dependencies offer."""

    device: str
    capability: tuple[int, int] | None = None
    blockwise_scaled_mm: bool = False  # torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128 / 128x128
    scaled_grouped_mm: bool = False  # torch._scaled_grouped_mm
    torchao: bool = False  # torchao.float8 (rowwise linears)
    cpu_rowwise_scaled_mm: bool = False  # torch._scaled_mm on CPU takes one scale per row (torch 2.11's: per tensor)
    deep_gemm: bool = False  # deep_gemm importable through torchao's blockwise MoE training wrapper
    torch_version: str = ""

    @staticmethod
    def detect(device: str | torch.device = "cuda") -> "Platform":
        """This machine's platform for `device` (its type: cuda means the current CUDA device; CPU when CUDA is
        absent)."""
        kind = torch.device(device).type
        if kind == "cuda" and not torch.cuda.is_available():
            kind = "cpu"
        return _detect(kind)

    def with_values(self, **values) -> "Platform":
        """A copy with some fields replaced (tests, and the benchmark's candidates)."""
        return dataclasses.replace(self, **values)

    def describe(self) -> str:
        sm = f" sm{self.capability[0]}{self.capability[1]}" if self.capability else ""
        return f"{self.device}{sm}, torch {self.torch_version}"


@functools.cache
def _detect(kind: str) -> Platform:
    torchao = importlib.util.find_spec("torchao") is not None
    if kind != "cuda":
        return Platform(kind, torchao=torchao, torch_version=torch.__version__,
                        cpu_rowwise_scaled_mm=kind == "cpu" and _cpu_rowwise_scaled_mm())
    F = torch.nn.functional
    scaling = getattr(F, "ScalingType", None)
    return Platform("cuda", torch.cuda.get_device_capability(), torch_version=torch.__version__,
                    blockwise_scaled_mm=hasattr(F, "scaled_mm") and hasattr(scaling, "BlockWise128x128"),
                    scaled_grouped_mm=hasattr(torch, "_scaled_grouped_mm"), torchao=torchao,
                    deep_gemm=torchao and _deep_gemm_usable())


def _cpu_rowwise_scaled_mm() -> bool:
    """torch._scaled_mm on CPU multiplies e4m3 operands with one scale per row: asked of the build by one 16 x 16
    product, since no release note says when it came (torch 2.11.0's CPU kernel asserts per-tensor scales inside
    oneDNN, which torchao's Float8Linear then hits at its first forward; 2.13.0's takes rowwise ones)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _deep_gemm_usable() -> bool:
    """deep_gemm imports with the grouped training kernels torchao's wrapper calls (an ABI mismatch fails here)."""
    if importlib.util.find_spec("deep_gemm") is None:
        return False
    try:  # optional dependencies: torchao's wrapper needs triton, and deep_gemm a matching build; any failure to
        # import them (an ImportError, or a build's own error at import) means the kernel is not there
        from torchao.prototype.blockwise_fp8_training.deepgemm_grouped_kernels import is_deep_gemm_available

        import torchao.prototype.moe_training.blockwise_fp8.grouped_mm  # noqa: F401
        return is_deep_gemm_available()
    except Exception:
        return False


def _hopper(p: Platform) -> bool:
    return p.device == "cuda" and p.capability is not None and p.capability[0] == 9


@dataclass(frozen=True)
class LinearKernels:
    """The kernel of each GEMM of one linear: forward, input gradient, weight gradient."""

    fwd: str
    dgrad: str
    wgrad: str


def rowwise_linear_kernel(p: Platform) -> str:
    """Rowwise linears: torchao's Float8Linear where `torch._scaled_mm` takes rowwise scales (CUDA sm89+, a CPU
    build that has them), else emulated."""
    fp8_device = (p.device == "cpu" and p.cpu_rowwise_scaled_mm) or \
        (p.device == "cuda" and p.capability is not None and p.capability >= (8, 9))
    return TORCHAO_LINEAR if p.torchao and fp8_device else EMULATED


def blockwise_linear_kernels(p: Platform, dtype: torch.dtype, tokens: int, in_features: int,
                             out_features: int) -> LinearKernels:
    """Blockwise linears: torch's scaled_mm on sm90 in bf16; the weight gradient contracts over the tokens, so it
    also needs `tokens` to be a multiple of 128 (its 1 x 128 tiles run along them)."""
    real = _hopper(p) and p.blockwise_scaled_mm and dtype == torch.bfloat16 and \
        in_features % BLOCK == 0 and out_features % BLOCK == 0
    blocks = SCALED_MM_BLOCKS if real else EMULATED
    return LinearKernels(blocks, blocks, SCALED_MM_TILES if real and tokens % BLOCK == 0 else EMULATED)


def grouped_kernel(p: Platform, recipe: str, dtype: torch.dtype, in_features: int, out_features: int) -> str:
    """The routed experts' grouped GEMMs (forward, dgrad and wgrad run the same kind). Every group starts on a
    multiple of 128 rows (`gemms.Fp8GroupedMM.row_align`), so only the weight dims matter."""
    if p.device != "cuda" or p.capability is None or dtype != torch.bfloat16:
        return EMULATED
    if recipe == "rowwise":
        aligned = in_features % ROWWISE_ALIGN == 0 and out_features % ROWWISE_ALIGN == 0
        return ROWWISE_GROUPED if p.scaled_grouped_mm and _hopper(p) and aligned else EMULATED
    if in_features % BLOCK or out_features % BLOCK or not _hopper(p):
        return EMULATED
    if p.deep_gemm:
        return DEEPGEMM
    return PER_EXPERT if p.blockwise_scaled_mm else EMULATED


def describe(p: Platform, recipe: str, mode: str = "auto") -> str:
    """One line naming the kernel of each GEMM kind for a bf16 run on `p` (the run's log, before the first step)."""
    if recipe == "none":
        return "fp8: none"
    if mode == EMULATED:
        return f"fp8 {recipe} kernels: emulated (fp8.kernels = emulated; {p.describe()})"
    if p.device != "cuda":
        return f"fp8 {recipe} kernels: emulated ({p.device.upper()}): quantise, dequantise, multiply in the compute " \
               "dtype" + ("; rowwise linears torchao Float8Linear (torch._scaled_mm)" if recipe == "rowwise" and
                          rowwise_linear_kernel(p) == TORCHAO_LINEAR else "")
    if recipe == "rowwise":
        linear = rowwise_linear_kernel(p)
        linears = f"linears {linear}" + (" (torch._scaled_mm rowwise)" if linear == TORCHAO_LINEAR else "")
    else:
        k = blockwise_linear_kernels(p, torch.bfloat16, BLOCK, BLOCK, BLOCK)
        linears = f"linears fwd/dgrad {k.fwd}, wgrad {k.wgrad}"
        if k.fwd != EMULATED:
            linears += " (a GEMM with a dim, tokens included, not a multiple of 128: emulated)"
    grouped = grouped_kernel(p, recipe, torch.bfloat16, BLOCK, BLOCK)
    return f"fp8 {recipe} kernels: {linears}; grouped experts {grouped} (bf16 compute; fp32 compute runs the " \
           f"emulation; {p.describe()})"
