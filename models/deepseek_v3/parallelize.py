"""Apply the parallelisms to a DeepSeek-V3 model (part), in the documented order:

    expert parallel -> activation checkpointing -> compile -> FSDP

Pipeline splitting happens before this, in `pipeline.py`; each stage is then parallelized here.
"""

from __future__ import annotations

from torch import nn


def parallelize_deepseek_v3(model: nn.Module, parallel_dims, meshes, job_config) -> nn.Module:
    """Single-process seam: nothing to apply yet when every degree is 1."""
    return model
