"""A second model family, small enough to read in one sitting: the worked example of docs/architecture.md
("Adding a model"). `tests/test_toy_model.py` registers it and trains it through the unchanged trainer.

A dense pre-norm network: token embedding, blocks of RMSNorm + SwiGLU MLP with a residual, final norm, head. It
has no attention (nothing mixes tokens), which is enough to show what a model family hands the trainer and the
generic layers; a real family puts its own blocks where `ToyBlock` is. Its plan applies FP8, activation
checkpointing, compile and FSDP to its own module names (`MODULE_DEFAULTS`, `RECOMPUTE_MODULES`, `compile_units`):
nothing outside this file names them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from core.config import ConfigError
from core.loss import cross_entropy_sum
from core.model_spec import ModelJob, ModelSpec, ParallelizeJob, PlanTables, register_model_spec
from core.names import ModuleDefaults
from models.common.init import init_parameters_
from parallelisms.activation_checkpoint.policy import ScopeRule, apply_ac
from parallelisms.compile import CompileUnit, apply_compile
from parallelisms.fsdp import FSDPUnit, apply_fsdp
from quantization.fp8.config import fp8_config_problem, fp8_selection
from quantization.fp8.convert import apply_fp8


@dataclasses.dataclass(frozen=True)
class ToyArgs:
    vocab_size: int = 2048
    dim: int = 128  # multiples of the FP8 tile, so that the blockwise recipe converts every linear
    hidden_dim: int = 256
    n_layers: int = 2


FLAVORS = {"tiny": ToyArgs()}


class ToyMLP(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ToyBlock(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.norm = nn.RMSNorm(args.dim)
        self.mlp = ToyMLP(args)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class ToyModel(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # keyed by layer id, as `apply_ac` replaces entries with checkpoint wrappers
        self.layers = nn.ModuleDict({str(i): ToyBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))

    def init_weights(self, buffer_device: torch.device | None = None, seed: int = 0) -> None:
        """Normal(0, 0.02) weights and unit norms, seeded per state_dict key: the same full weights on any layout."""
        params = {id(p) for p in self.parameters()}

        def rule(fqn: str):
            return (lambda t, g: t.fill_(1.0)) if "norm" in fqn else (lambda t, g: t.normal_(0, 0.02, generator=g))

        init_parameters_(((fqn, tensor, rule(fqn)) for fqn, tensor in self.state_dict(keep_vars=True).items()
                          if id(tensor) in params), seed)


#: the names `activation_checkpoint.recompute_modules` accepts for this family, and the submodules they cover
RECOMPUTE_MODULES = {"mlp": (ScopeRule("mlp"),), "layernorm": (ScopeRule("norm"),)}

#: this family's choices where `fp8.modules`, `fp8.exclude_modules` and `force_recompute_modules` say "default"
MODULE_DEFAULTS = ModuleDefaults(fp8_modules=("mlp",), force_recompute_modules=("norm",))


def build_args(job: ModelJob) -> ToyArgs:
    if job.model.flavor not in FLAVORS:
        raise ConfigError("model.flavor", f"unknown flavor {job.model.flavor!r}", ", ".join(FLAVORS))
    args = FLAVORS[job.model.flavor]
    with torch.device("meta"):
        problem = fp8_config_problem(fp8_selection(job.fp8, MODULE_DEFAULTS), [ToyBlock(args)])
    if problem is not None:
        raise ConfigError(*problem)
    return args


def compile_units(model: ToyModel) -> list[CompileUnit]:
    """Every block is one graph (they differ only in their weights, so they share it)."""
    return [CompileUnit(block, block) for block in model.layers.values()]


def parallelize(model: ToyModel, parallel_dims, meshes, job: ParallelizeJob) -> ToyModel:
    """The family's plan: the generic FP8, activation checkpointing, compile and FSDP over its own modules (no EP:
    no experts)."""
    apply_fp8({f"layers.{i}": block for i, block in model.layers.items()}, fp8_selection(job.fp8, MODULE_DEFAULTS))
    apply_ac(model.layers, job.activation_checkpoint, RECOMPUTE_MODULES, MODULE_DEFAULTS.force_recompute_modules)
    apply_compile(compile_units(model), job.compile, graphs_per_code=2 * model.args.n_layers)
    if parallel_dims.dp_enabled:
        units = [FSDPUnit(model.tok_embeddings), *(FSDPUnit(b) for b in model.layers.values()),
                 FSDPUnit([model.norm, model.output], reshard_after_forward=False)]
        apply_fsdp(units, model, meshes, job.dtype, job.reduce_dtype, reshard_after_forward=True)
    return model


def counts(args: ToyArgs, seq_len: int) -> tuple[int, int, float]:
    """(total params, active params, training FLOPs per token: 6 per weight of a matmul)."""
    block = 2 * args.dim + 3 * args.dim * args.hidden_dim
    total = 2 * args.vocab_size * args.dim + args.n_layers * block + args.dim
    matmul = args.n_layers * 3 * args.dim * args.hidden_dim + args.dim * args.vocab_size
    return total, total, 6.0 * matmul


SPEC = ModelSpec(
    name="toy_dense",
    model_cls=ToyModel,
    build_args=build_args,
    parallelize=parallelize,
    build_loss_fn=lambda args: cross_entropy_sum,
    param_and_flop_counts=counts,
    plan=PlanTables(recompute_modules=RECOMPUTE_MODULES, module_defaults=MODULE_DEFAULTS, compile_units=compile_units),
)


def register() -> None:
    """Make `model.name = "toy_dense"` available (a package under models/ would register on import)."""
    register_model_spec(SPEC)
