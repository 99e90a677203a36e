"""Apply the parallelisms to a DeepSeek-V3 model (part), in the documented order:

    expert parallel -> FP8 conversion -> activation checkpointing -> compile -> FSDP

Pipeline splitting happens before this (`parallelisms/pipeline.py`); each stage is then parallelized here.
FSDP comes last so that its hooks wrap the checkpointed and compiled blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.expert_parallel import apply_expert_parallel
from parallelisms.fp8 import apply_fp8
from parallelisms.fsdp import apply_fsdp


def parallelize_deepseek_v3(model: nn.Module, parallel_dims, meshes, job_config) -> nn.Module:
    """Parallelize `model` in place for the degrees in `parallel_dims` and return it."""
    par = job_config.parallelism
    if parallel_dims.ep_enabled:
        # the backend's comm state is created here: never lazily inside a checkpointed region (torchtitan #2505)
        dtype = torch.bfloat16 if job_config.training.dtype == "bfloat16" else torch.float32
        apply_expert_parallel(model.moe_layers(), meshes.ep, par.expert_parallel_comm_backend, model.args.dim, dtype)
    apply_fp8(model, job_config.fp8)
    apply_ac(model, job_config.activation_checkpoint)
    apply_compile(model, job_config.compile)
    if parallel_dims.dp_enabled:
        reshard = {"always": True, "never": False}.get(par.fsdp_reshard_after_forward,
                                                        not parallel_dims.pp_enabled)
        apply_fsdp(model, meshes, job_config.training.dtype, job_config.training.mixed_precision_reduce, reshard)
    return model
