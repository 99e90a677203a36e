"""FP8 checkpoints: dequantization of DeepSeek-V3's float8_e4m3fn weights and their 128x128 block scales.

Export never writes FP8, so only the import side lives here (`io.py` and `state_dict.py` call `_dequantized`).
"""

from __future__ import annotations

from typing import Callable

import torch

from core.quantization import FP8_TILE

FP8_BLOCK = FP8_TILE  # DeepSeek-V3's FP8 checkpoints scale each 128x128 block of a weight by one fp32 factor


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

