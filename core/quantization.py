"""The contract between a model's routed experts and a precision conversion, and the FP8 tile every party uses.

A grouped-experts module that supports a lower-precision GEMM holds the attribute named `QUANTIZED_MM` (None: the
module's own GEMM). A conversion (`quantization.fp8.apply_fp8`) finds such modules by that attribute, never by
their class, and sets it to a `QuantizedGroupedMM`; the module then pads each expert's rows to a multiple of its
`row_align` and calls it for each projection. The model never imports the conversion.

`FP8_TILE` is DeepSeek-V3's FP8 tile: 1 x 128 activation tiles and 128 x 128 weight blocks in training, the
128-wide token groups of FP8 dispatch, and the 128 x 128 blocks of its FP8 checkpoints.
"""

from __future__ import annotations

from typing import Protocol

import torch

QUANTIZED_MM = "quantized_mm"
FP8_TILE = 128


class QuantizedGroupedMM(Protocol):
    """A grouped GEMM in a lower precision: rows of group e times w[e]^T, computed in x's dtype."""

    #: every group must start on a multiple of this many rows, and the row count be one (pad with zero rows)
    row_align: int

    def host_offsets(self, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor | None:
        """offs_E copied to the host if the GEMM of these operands reads the group offsets there (a host sync), else
        None: the module copies them once for all of a layer's projections and passes the copy to each call."""
        ...

    def __call__(self, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                 host_offs_E: torch.Tensor | None = None) -> torch.Tensor:
        """x_PK's rows grouped by the int32 end offsets offs_E, times the stored weights w_ENK [E, out, in];
        `host_offs_E`: `host_offsets`' copy, if it gave one."""
        ...
