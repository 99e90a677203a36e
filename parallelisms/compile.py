"""torch.compile of the transformer blocks and of the loss (the `[compile]` section).

`apply_compile(model, compile_cfg)` compiles every block of a model part in place (`Module.compile`, so parameter
names, state_dict keys and attribute access do not change). It runs after expert parallelism and activation
checkpointing and before FSDP, so a block may already be a `CheckpointWrapper` (compile(AC(block))) and FSDP's
hooks, which run in `Module.__call__` outside the compiled `forward`, wrap the compiled block.

Two shapes of compiled block, chosen per block by whether its token dispatcher can be traced:

    dense block, or MoE block with a traceable dispatcher (`LocalTokenDispatcher`, EP = 1):
        the whole block is one graph (`fullgraph=True`): attention, router, sort, grouped experts, combine,
        shared experts, token counting and the aux-loss hook. Every shape is fixed by (batch, seq): the grouped
        layout always has B*S*top_k rows, and the per-expert counts are a device tensor of offsets, so changing
        routing never changes a shape and never recompiles.

    MoE block whose dispatcher is not traceable (EP backends: host syncs such as the split sizes, collectives):
        the block's children are compiled, each with `fullgraph=True`: attention, the router, the grouped
        experts and the shared experts. `TransformerBlock.forward` (two RMSNorms, residual adds) and
        `MoE.forward` (counting, dispatch, weighting, combine) stay eager, so the host sync and the collectives
        never enter a graph, and an eager activation-checkpoint recompute never counts tokens twice. The
        grouped experts see a different number of rows every step (sometimes none); that dimension is marked
        dynamic (unbacked) before the first compile, so one graph serves every step.

`compile_loss(loss_fn, compile_cfg)` compiles the loss on its own, with the batch and sequence dimensions dynamic
(validation, a shorter last batch or another seq_len reuse the graph).

See docs/compile.md for where graphs break and why, numerics and measurements.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from trainer.config import ConfigError, option
from trainer.torch_compat import torch_at_least


@dataclass
class CompileSection:
    """torch.compile."""

    enable: bool = False
    """Compile the components listed in components."""
    components: list[str] = option(["model", "loss"], item_choices=["model", "loss"])
    """What to compile: the transformer blocks (model) and/or the loss."""
    backend: str = "inductor"
    """torch.compile backend."""

    def check(self) -> list[ConfigError]:
        """Settings of this section that contradict each other."""
        if self.enable and not self.components:
            return [ConfigError("components", "empty while compile.enable is true, so nothing would compile",
                                "model, loss")]
        return []


__all__ = ["SECONDS_PER_GRAPH", "apply_compile", "compile_loss", "compiled_modules", "first_compile"]

SECONDS_PER_GRAPH = 15
"""Cold compile time of one graph (forward + backward), measured on the 2-core CPU dev machine: 35-45 s for the
debug model's three graphs (docs/compile.md). Only for the estimate the trainer logs before the first step."""

logger = logging.getLogger(__name__)


def apply_compile(model: nn.Module, compile_cfg) -> nn.Module:
    """Compile the blocks of `model` (a DeepSeek-V3 model or pipeline stage) in place; returns `model`.

    A no-op unless `compile_cfg.enable` and "model" is in `compile_cfg.components`. Call it after
    `apply_expert_parallel` (the dispatcher decides the structure) and `apply_ac`, and before `apply_fsdp`.
    """
    if not (compile_cfg.enable and "model" in compile_cfg.components):
        return model
    # Blocks that differ only in their weights share one graph. A wrapper holding per-block Python state (the
    # selective-AC policy object of each block) makes dynamo compile every block on its own, and past
    # `recompile_limit` graphs per code object fullgraph=True fails: allow a training and an eval graph per block.
    args = model.args
    compile_kwargs = dict(backend=compile_cfg.backend, fullgraph=True)
    _allow_recompiles(compile_kwargs, 2 * (args.n_layers + args.num_mtp_layers))
    for block in _blocks(model):
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        if inner.moe_enabled and not inner.moe.experts.use_grouped_mm:
            # the per-expert loop slices by counts read on the host: under fullgraph those become unbacked sizes,
            # on which inductor's CPU codegen fails in torch 2.13 (see docs/compile.md)
            raise ValueError("compiling the model needs moe.use_grouped_mm = true (the per-expert loop is the "
                             "eager reference path)")
        if inner.moe_enabled and not inner.moe.dispatcher.traceable:
            _compile_around_dispatcher(inner, compile_kwargs)
        else:
            block.compile(**compile_kwargs)
    return model


def _allow_recompiles(compile_kwargs: dict, graphs: int) -> None:
    """Let every code object compiled with `compile_kwargs` hold at least `graphs` graphs.

    torch.compile takes a per-call `recompile_limit` from torch 2.13 on (2.11 rejects the keyword with a
    TypeError); before that the same limit exists only process-wide, as dynamo's config, which is raised instead.
    """
    limit = max(torch._dynamo.config.recompile_limit, graphs)
    if torch_at_least(2, 13):
        compile_kwargs["recompile_limit"] = limit
    elif torch._dynamo.config.recompile_limit < limit:
        logger.info("torch %s has no per-call recompile_limit: raising torch._dynamo.config.recompile_limit to %d "
                    "for the whole process", torch.__version__, limit)
        torch._dynamo.config.recompile_limit = limit


def compiled_modules(model: nn.Module) -> list[str]:
    """Names of the modules of `model` that `apply_compile` compiled (for logs and tests)."""
    return [name for name, module in model.named_modules() if getattr(module, "_compiled_call_impl", None)]


def first_compile(models: list[nn.Module]) -> tuple[int, int]:
    """(blocks holding compiled code, distinct graphs their first call compiles) of the model parts of one process
    after `apply_compile`.

    An estimate for the log. Compiled modules share a graph when they run the same code with the same structure
    (a dense and an MoE block differ; so do a checkpointed and a plain block) and the same activation-checkpoint
    `context_fn` object: selective AC gives every block its own policy, which dynamo guards by identity.
    """
    blocks = sum(any(getattr(m, "_compiled_call_impl", None) for m in block.modules())
                 for model in models for block in _blocks(model))
    graphs = set()
    for module in (m for model in models for m in model.modules()):
        if getattr(module, "_compiled_call_impl", None) is None:
            continue
        wrapped = isinstance(module, CheckpointWrapper)
        inner = module._checkpoint_wrapped_module if wrapped else module
        context_fn = module.checkpoint_fn.keywords.get("context_fn") if wrapped else None
        graphs.add((type(module), type(inner), getattr(inner, "moe_enabled", None), context_fn))
    return blocks, len(graphs)


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = list(model.layers.values())
    if model.mtp is not None:
        blocks += [mod.block for mod in model.mtp.layers]
    return blocks


def _compile_around_dispatcher(block: nn.Module, compile_kwargs: dict) -> None:
    """Compile everything of an MoE block except the glue around its (host-synchronising) dispatcher."""
    moe = block.moe
    # Not the two RMSNorms: one op each (the fused kernel on CUDA), with nothing to fuse with, since the residual
    # adds around them stay eager. (Before models/deepseek_v3/norm.py they were torch's own nn.RMSNorm, whose
    # forward is in dynamo's skip files, so `Module.compile` could not compile them under fullgraph=True.)
    pieces = [block.attention, moe.router, moe.experts]
    if moe.shared_experts is not None:
        pieces.append(moe.shared_experts)
    for piece in pieces:
        piece.compile(**compile_kwargs)
    moe.experts.register_forward_pre_hook(_rows_unbacked)


@torch.compiler.disable
def _rows_unbacked(experts: nn.Module, args: tuple) -> None:
    """Forward pre-hook of compiled grouped experts fed by a communicating dispatcher; runs eagerly.

    The number of rows a rank receives changes every step. Marked dynamic before the first compile, one graph
    serves every count (no recompile at step 2, when `automatic_dynamic_shapes` would notice the change).
    Unbacked rather than `mark_dynamic`: a backed size is specialised at 0 and 1 and would compile again for a
    rank that receives no rows or one row; nothing in the experts needs to branch on the row count.
    """
    torch._dynamo.decorators.mark_unbacked(args[0], 0)


def compile_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], compile_cfg
                 ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`loss_fn(output, labels)` compiled with `fullgraph=True`, or `loss_fn` itself when the loss is not compiled.

    output is [..., B, S, V] (an MTP model stacks depths in front), labels [B, S]. B and S are marked dynamic on
    every call, so one graph serves every batch and sequence length (else each new (B, S) would compile again and
    the recompile limit would send the loss back to eager).
    """
    if not (compile_cfg.enable and "loss" in compile_cfg.components):
        return loss_fn
    compiled = torch.compile(loss_fn, backend=compile_cfg.backend, fullgraph=True)

    @functools.wraps(loss_fn)
    def loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # maybe_: a size-1 batch (or sequence) is specialised instead of raising
        torch._dynamo.maybe_mark_dynamic(output, [output.dim() - 3, output.dim() - 2])
        torch._dynamo.maybe_mark_dynamic(labels, [0, 1])
        return compiled(output, labels)

    return loss
