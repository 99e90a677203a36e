"""The DeepSeek-V3 parallelize plan: the one place that tells the generic parallelisms which modules to work on.

Order (per pipeline stage; pipeline splitting happens before this, in `parallelisms/pipeline.py`):

    expert parallel -> FP8 conversion (and FP8 dispatch with it) -> activation checkpointing -> compile -> FSDP

FSDP comes last so that its hooks wrap the checkpointed and compiled blocks. `parallelisms/` holds the generic
`apply_*` functions; this module builds their inputs from the model (the recompute-name table, the compile units,
the FSDP units and prefetch order) and passes every piece of state explicitly.

Compile units, chosen per block by whether its token dispatcher can be traced:

    dense block, or MoE block with a traceable dispatcher (`LocalTokenDispatcher`, EP = 1):
        the whole block is one graph: attention, router, sort, grouped experts, combine, shared experts, token
        counting and the aux-loss hook. Every shape is fixed by (batch, seq): the grouped layout always has
        B*S*top_k rows, and the per-expert counts are a device tensor of offsets, so changing routing never
        changes a shape and never recompiles.

    MoE block whose dispatcher is not traceable (EP backends: host syncs such as the split sizes, collectives):
        attention, the router, the grouped experts and the shared experts, each its own graph.
        `TransformerBlock.forward` (two RMSNorms, residual adds) and `MoE.forward` (counting, dispatch,
        weighting, combine) stay eager, so the host sync and the collectives never enter a graph, and an eager
        activation-checkpoint recompute never counts tokens twice. The grouped experts see a different number
        of rows every step (sometimes none): they are a `dynamic_rows` unit.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from core.model_spec import ParallelizeJob
from core.names import ModuleDefaults
from core.quantization import QUANTIZED_MM
from parallelisms.activation_checkpoint.policy import ScopeRule, apply_ac
from parallelisms.compile import CompileUnit, apply_compile, compiles_model
from parallelisms.context_parallel import ContextParallel
from parallelisms.expert_parallel import apply_expert_parallel
from parallelisms.fsdp import FSDPUnit, apply_fsdp
from quantization.fp8.config import fp8_selection
from quantization.fp8.convert import apply_fp8, apply_fp8_all_gather

logger = logging.getLogger(__name__)

#: Megatron-Core `--recompute-modules` names (`activation_checkpoint.recompute_modules`) and what they recompute
#: in a DeepSeek-V3 block: module names are FQN suffixes inside a block.
RECOMPUTE_MODULES: dict[str, tuple[ScopeRule, ...]] = {
    # The attention core between the projections: RoPE, q/k assembly, SDPA (fused, or its math path on CPU).
    "core_attn": (ScopeRule("attention", direct_only=True),),
    # The MLA up-projections from the compressed latents, with the latent norms in front of them.
    "mla_up_proj": (ScopeRule("attention.q_norm"), ScopeRule("attention.wq_b"), ScopeRule("attention.kv_norm"),
                    ScopeRule("attention.wkv_b")),
    # The SwiGLU activation of the routed experts (silu and the gate product); the grouped GEMMs follow save_ops.
    "moe_act": (ScopeRule("moe.experts", kinds=("silu", "mul")),),
    # The block's two pre-norms (the MLA latent norms belong to mla_up_proj).
    "layernorm": (ScopeRule("attention_norm"), ScopeRule("ffn_norm")),
    # The dense SwiGLU FFN of the first n_dense_layers blocks.
    "mlp": (ScopeRule("feed_forward"),),
    # The whole MoE layer: router, dispatch, experts, combine, shared experts (collectives stay saved).
    "moe": (ScopeRule("moe"),),
    "shared_experts": (ScopeRule("moe.shared_experts"),),
}

#: DeepSeek-V3's choices where a config key that names modules says "default" (`core.names`).
MODULE_DEFAULTS = ModuleDefaults(
    # every linear of a block and the routed experts: the GEMMs of DeepSeek-V3's FP8 recipe
    fp8_modules=("attention", "feed_forward", "moe.experts", "moe.shared_experts"),
    # wkv_a's output, kv_lora_rank + qk_rope_head_dim = 576 in the DeepSeek flavors, is not a multiple of 128
    fp8_exclude_modules=("attention.wkv_a",),
    # the router's GEMM is tiny (tokens x experts): recomputing it costs less than keeping its output
    force_recompute_modules=("moe.router.gate",),
)

def compile_problem(args) -> str | None:
    """Why a model of `args` cannot be compiled, or None. The per-expert loop (`moe.use_grouped_mm = false`, the
    eager reference path) slices by counts read on the host: under fullgraph those become unbacked sizes, on which
    inductor's CPU code generation fails in torch 2.13 (docs/compile.md)."""
    if not args.use_grouped_mm and args.n_layers > args.n_dense_layers:
        return "the per-expert loop syncs with the host and cannot be compiled"
    return None


def parallelize_deepseek_v3(model: nn.Module, parallel_dims, meshes, job: ParallelizeJob) -> nn.Module:
    """Parallelize `model` in place for the degrees in `parallel_dims` and return it."""
    par = job.parallelism
    if parallel_dims.cp_enabled:
        attach_context_parallel(model, ContextParallel.of_meshes(meshes))
    if parallel_dims.ep_enabled:
        # the backend's comm state is created here: never lazily inside a checkpointed region (torchtitan #2505)
        dtype = torch.bfloat16 if job.dtype == "bfloat16" else torch.float32
        apply_expert_parallel(model.moe_layers(), meshes.ep, par.expert_parallel_comm_backend, model.args.dim, dtype)
    apply_fp8(named_blocks(model), fp8_selection(job.fp8, MODULE_DEFAULTS))
    if parallel_dims.ep_enabled:
        quantize_dispatch(model, job.fp8, routed_experts_dtype(meshes.ep, job))
    checkpoint_model(model, job.activation_checkpoint)
    compile_model(model, job.compile, fp8=job.fp8.recipe != "none")
    if parallel_dims.sharded:
        reshard = {"always": True, "never": False}.get(par.fsdp_reshard_after_forward,
                                                        not parallel_dims.pp_enabled)
        if job.fp8.all_gather:
            experts = meshes.experts if meshes.experts is not None else meshes.dense
            apply_fp8_all_gather(model, meshes.dense.shape[-1], experts.shape[-1],
                                 routed_experts_dtype(meshes.dense, job))
        shard_model(model, meshes, job.dtype, job.reduce_dtype, reshard)
    return model


def attach_context_parallel(model: nn.Module, context_parallel) -> None:
    """Give the model part and every attention and MoE layer in it this rank's `ContextParallel`: the model keeps
    its share of each sequence, attention gathers the whole sequence's compressed keys and values, the
    sequence-wise aux loss counts the whole sequence."""
    model.context_parallel = context_parallel
    for block in blocks(model):
        block.attention.context_parallel = context_parallel
        if block.moe_enabled:
            block.moe.context_parallel = context_parallel


def routed_experts_dtype(mesh, job: ParallelizeJob) -> torch.dtype | None:
    """The dtype the routed experts compute in where it is fixed: bf16 on CUDA and under compile
    (`moe._experts_grouped_mm`), else None (their input's, or autocast's). FP8 dispatch and FSDP's gathered blocks
    quantise from it, as the experts' GEMMs do."""
    return torch.bfloat16 if mesh.device_type == "cuda" or compiles_model(job.compile) else None


def quantize_dispatch(model: nn.Module, fp8_cfg, experts_dtype: torch.dtype | None = None) -> int:
    """With the blockwise recipe and `fp8.dispatch`, ask the dispatcher of every MoE layer whose routed experts run
    in FP8 to send their inputs as e4m3 in the experts' own 1 x 128 tiles, quantised from `experts_dtype` (the
    dtype the experts compute in where it is fixed; None: the rows' or autocast's); returns how many layers will."""
    if not fp8_cfg.dispatch_tile:
        return 0
    fp8_layers = [moe for moe in model.moe_layers() if getattr(moe.experts, QUANTIZED_MM, None) is not None]
    quantized = sum(moe.dispatcher.quantize_wire(fp8_cfg.dispatch_tile, experts_dtype) for moe in fp8_layers)
    if fp8_layers:
        backend = type(fp8_layers[0].dispatcher).__name__
        logger.info("fp8 dispatch: %d of %d MoE layers with FP8 experts send e4m3 rows (%s)%s", quantized,
                    len(fp8_layers), backend, "" if quantized else "; this backend sends the compute dtype")
    return quantized


def named_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The transformer blocks of a model part in forward order, by their names in the model: its layers, then the
    MTP blocks."""
    found = {f"layers.{key}": block for key, block in model.layers.items()}
    if model.mtp is not None:
        found.update({f"mtp.layers.{i}.block": mod.block for i, mod in enumerate(model.mtp.layers)})
    return found


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model part in forward order: its layers, then the MTP blocks."""
    return list(named_blocks(model).values())


def _unwrap(block: nn.Module) -> nn.Module:
    return block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block


# ----------------------------------------------------------------------------------------------- activation ckpt

def checkpoint_model(model: nn.Module, ac_cfg) -> nn.Module:
    """`apply_ac` on the layers (not the MTP blocks) with this model's recompute-name table and defaults; returns
    `model`."""
    apply_ac(model.layers, ac_cfg, RECOMPUTE_MODULES, MODULE_DEFAULTS.force_recompute_modules)
    return model


# ----------------------------------------------------------------------------------------------- compile

def compile_units(model: nn.Module) -> list[CompileUnit]:
    """What `apply_compile` compiles in a model part (see the module docstring); also what the trainer's
    compile-time estimate counts."""
    units = []
    for block in blocks(model):
        inner = _unwrap(block)
        if inner.moe_enabled and not inner.moe.dispatcher.traceable:
            moe = inner.moe
            # Not the two RMSNorms: one op each (the fused kernel on CUDA), with nothing to fuse with, since the
            # residual adds around them stay eager. (Before models/deepseek_v3/norm.py they were torch's own
            # nn.RMSNorm, whose forward is in dynamo's skip files: `Module.compile` could not compile them.)
            pieces = [inner.attention, moe.router, moe.experts]
            if moe.shared_experts is not None:
                pieces.append(moe.shared_experts)
            units += [CompileUnit(piece, block, dynamic_rows=piece is moe.experts) for piece in pieces]
        else:
            units.append(CompileUnit(block, block, variant=inner.moe_enabled))
    return units


def compile_model(model: nn.Module, compile_cfg, fp8: bool = False) -> nn.Module:
    """`apply_compile` on this model part's compile units (with eager's roundings when `fp8`: the model quantises to
    FP8); returns `model`. ValueError for a model that cannot be compiled (`compile_problem`)."""
    problem = compile_problem(model.args)
    if problem is not None and compiles_model(compile_cfg):
        raise ValueError(f"moe.use_grouped_mm: {problem}")
    # Blocks that differ only in their weights share one graph. A wrapper holding per-block Python state (the
    # selective-AC policy object of each block) makes dynamo compile every block on its own, and past the recompile
    # limit fullgraph=True fails: allow a training and an eval graph per block of the whole model (the stages of
    # one pipeline rank share code objects).
    graphs_per_code = 2 * (model.args.n_layers + model.args.num_mtp_layers)
    apply_compile(compile_units(model), compile_cfg, graphs_per_code, eager_roundings=fp8)
    return model


# ----------------------------------------------------------------------------------------------- FSDP

def shard_model(model: nn.Module, meshes, param_dtype: str, reduce_dtype: str, reshard_after_forward: bool) -> None:
    """`apply_fsdp` with this model's units: the embedding, each block (its routed experts first, on the experts
    mesh, when EP splits them), the MTP blocks, [norm, output] together, then the model."""
    embedding = [model.tok_embeddings] if model.tok_embeddings is not None else []
    units = [FSDPUnit(m) for m in embedding]
    for block in blocks(model):
        if meshes.experts is not None and block.moe_enabled:
            units.append(FSDPUnit(block.moe.experts, mesh="experts"))
        units.append(FSDPUnit(block))
    head = [m for m in (model.norm, model.output) if m is not None]
    if head:
        # the head runs last in forward and first in backward: resharding it in between only adds an all-gather
        units.append(FSDPUnit(head, reshard_after_forward=False))
    prefetch = {}
    if meshes.ep is not None:
        # With EP, every MoE layer syncs with the host (split sizes), which stalls FSDP's implicit prefetch of the
        # next block's all-gather: name the next units explicitly so their all-gathers are issued early.
        steps = [[block, block.moe.experts] if block.moe_enabled else [block] for block in blocks(model)]
        prefetch = dict(forward_prefetch=([embedding] if embedding else []) + steps, backward_prefetch=steps)
    apply_fsdp(units, model, meshes, param_dtype, reduce_dtype, reshard_after_forward, **prefetch)
