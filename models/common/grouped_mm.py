"""The hook through which a precision conversion replaces the grouped GEMM of a model's routed experts.

A grouped-experts module that supports it holds the attribute named `QUANTIZED_MM` (None: the module's own GEMM).
A conversion (`parallelisms.fp8.apply_fp8`) finds such modules by that attribute, never by their class, and sets it
to a `QuantizedGroupedMM`; the module then pads each expert's rows to a multiple of its `row_align` and calls it for
each projection. The model never imports the conversion.
"""

from __future__ import annotations

from typing import Protocol

import torch

QUANTIZED_MM = "quantized_mm"


class QuantizedGroupedMM(Protocol):
    """A grouped GEMM in a lower precision: rows of group e times w[e]^T, computed in x's dtype."""

    #: every group must start on a multiple of this many rows, and the row count be one (pad with zero rows)
    row_align: int

    def __call__(self, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        """x_PK's rows grouped by the int32 end offsets offs_E, times the stored weights w_ENK [E, out, in]."""
        ...
