"""torch.compile of the units a model's parallelize plan hands in, and of the loss (the `[compile]` section).

`apply_compile(units, compile_cfg, graphs_per_code)` compiles each `CompileUnit` in place (`Module.compile`, so
parameter names, state_dict keys and attribute access do not change), each with `fullgraph=True`. It runs after
expert parallelism and activation checkpointing and before FSDP, so a unit may already be a `CheckpointWrapper`
(compile(AC(block))) and FSDP's hooks, which run in `Module.__call__` outside the compiled `forward`, wrap the
compiled unit. The plan decides what a unit is: a whole block, or, where part of a block cannot be traced (a
dispatcher that syncs with the host or communicates), the pieces around that part, which then stays eager. A
unit whose leading input dimension changes every step (rows received from other ranks) is marked
`dynamic_rows`: that dimension is marked dynamic (unbacked) before the first compile, so one graph serves every
step. models/deepseek_v3/parallelize.py is the DeepSeek-V3 plan.

`compile_loss(loss_fn, compile_cfg)` compiles the loss on its own, with the batch and sequence dimensions dynamic
(validation, a shorter last batch or another seq_len reuse the graph).

See docs/compile.md for where graphs break and why, numerics and measurements.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from parallelisms.torch_compat import torch_at_least
from core.config import ConfigError, option


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


__all__ = ["EAGER_ROUNDINGS", "SECONDS_PER_GRAPH", "CompileSection", "CompileUnit", "apply_compile", "compile_loss",
           "compiled_modules", "compiles_model", "first_compile"]

SECONDS_PER_GRAPH = 15
"""Cold compile time of one graph (forward + backward) on the 2-core CPU dev machine, from the measurement in
docs/compile.md ("Measured gains"). Only for the estimate the trainer logs before the first step."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileUnit:
    """One module to compile with `fullgraph=True`, as a model's parallelize plan hands it in.

    module: compiled in place.
    block: the model block it belongs to (the module itself for a whole block); the log counts blocks.
    variant: tells apart modules of one class whose forward traces to different graphs (a dense and an MoE
        block, say); None when the class alone decides.
    dynamic_rows: the leading dimension of its first input changes every step (sometimes 0): marked unbacked
        before every call, so the first compile already serves every count.
    """

    module: nn.Module
    block: nn.Module
    variant: Hashable = None
    dynamic_rows: bool = False


def compiles_model(compile_cfg) -> bool:
    """Whether the `[compile]` section compiles the model's units (not only the loss)."""
    return compile_cfg.enable and "model" in compile_cfg.components


#: inductor options that keep eager's roundings to bf16 inside fused kernels. By default inductor drops the rounding
#: of an intermediate cast (an fp32 master weight's `.to(bfloat16)` fused with the FP8 quantisation after it), so
#: a compiled graph quantised the fp32 values themselves: 3% of the e4m3 values of a weight differed from eager's
#: and the emulation's, and the compiled FP8 linear's output parted from eager's by 1.6% (H200, 2026-11-27).
EAGER_ROUNDINGS = {"emulate_precision_casts": True}


def apply_compile(units: Sequence[CompileUnit], compile_cfg, graphs_per_code: int,
                  eager_roundings: bool = False) -> None:
    """Compile `units` in place when `compile_cfg.enable` and "model" is in `compile_cfg.components`.

    graphs_per_code: how many graphs one code object may need in this process (the recompile limit); past it
        fullgraph=True fails. Call it after `apply_expert_parallel` (the dispatcher decides the units) and
        `apply_ac`, and before `apply_fsdp`.
    eager_roundings: compile with `EAGER_ROUNDINGS` (inductor only): for units that quantise to FP8, whose e4m3
        values must not depend on whether the graph is compiled.
    """
    if not compiles_model(compile_cfg):
        return
    compile_kwargs = dict(backend=compile_cfg.backend, fullgraph=True)
    if eager_roundings and compile_cfg.backend == "inductor":
        compile_kwargs["options"] = dict(EAGER_ROUNDINGS)
    _allow_recompiles(compile_kwargs, graphs_per_code)
    for unit in units:
        unit.module.compile(**compile_kwargs)
        if unit.dynamic_rows:
            unit.module.register_forward_pre_hook(_rows_unbacked)


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


def first_compile(units: Sequence[CompileUnit]) -> tuple[int, int]:
    """(blocks holding compiled code, distinct graphs their first call compiles) of the compile units of one
    process's model parts after `apply_compile` (units left uncompiled count for nothing).

    An estimate for the log. Compiled modules share a graph when they run the same code with the same structure
    (the unit's class and `variant`; a checkpointed and a plain block differ) and the same activation-checkpoint
    `context_fn` object: selective AC gives every block its own policy, which dynamo guards by identity.
    """
    compiled = [u for u in units if getattr(u.module, "_compiled_call_impl", None) is not None]
    graphs = set()
    for unit in compiled:
        module = unit.module
        wrapped = isinstance(module, CheckpointWrapper)
        inner = module._checkpoint_wrapped_module if wrapped else module
        context_fn = module.checkpoint_fn.keywords.get("context_fn") if wrapped else None
        graphs.add((type(module), type(inner), unit.variant, context_fn))
    return len({id(u.block) for u in compiled}), len(graphs)


@torch.compiler.disable
def _rows_unbacked(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a compiled `dynamic_rows` unit (its rows come from other ranks); runs eagerly.

    The number of rows a rank receives changes every step. Marked dynamic before the first compile, one graph
    serves every count (no recompile at step 2, when `automatic_dynamic_shapes` would notice the change).
    Unbacked rather than `mark_dynamic`: a backed size is specialised at 0 and 1 and would compile again for a
    rank that receives no rows or one row; the unit must not branch on the row count.
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
