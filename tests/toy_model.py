"""A second model family, small enough to read in one sitting: the worked example of docs/architecture.md
("Adding a model"). `tests/test_toy_model.py` registers it and trains it through the unchanged trainer.

A dense pre-norm network: token embedding, blocks of RMSNorm + SwiGLU MLP with a residual, final norm, head. It
has no attention (nothing mixes tokens), which is enough to show what a model family hands the trainer and the
generic parallelisms; a real family puts its own blocks where `ToyBlock` is.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import init_parameter_
from parallelisms.activation_checkpoint.policy import ScopeRule, apply_ac
from parallelisms.fsdp import FSDPUnit, apply_fsdp
from core.config import ConfigError
from core.loss import cross_entropy_sum
from core.model_spec import ModelSpec, register_model_spec


@dataclasses.dataclass(frozen=True)
class ToyArgs:
    vocab_size: int = 2048
    dim: int = 64
    hidden_dim: int = 128
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
        for fqn, tensor in self.state_dict(keep_vars=True).items():
            if id(tensor) in params:
                rule = (lambda t, g: t.fill_(1.0)) if "norm" in fqn else (lambda t, g: t.normal_(0, 0.02, generator=g))
                init_parameter_(tensor, rule, seed, fqn)


#: the names `activation_checkpoint.recompute_modules` accepts for this family, and the submodules they cover
RECOMPUTE_MODULES = {"mlp": (ScopeRule("mlp"),), "layernorm": (ScopeRule("norm"),)}


def build_args(job_config) -> ToyArgs:
    if job_config.model.flavor not in FLAVORS:
        raise ConfigError("model.flavor", f"unknown flavor {job_config.model.flavor!r}", ", ".join(FLAVORS))
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError("compile.components", "the toy model has no compile units", '["loss"] or compile off')
    return FLAVORS[job_config.model.flavor]


def parallelize(model: ToyModel, parallel_dims, meshes, job_config) -> ToyModel:
    """The family's plan: generic activation checkpointing and FSDP over its own modules (no EP: no experts)."""
    apply_ac(model.layers, job_config.activation_checkpoint, RECOMPUTE_MODULES)
    if parallel_dims.dp_enabled:
        units = [FSDPUnit(model.tok_embeddings), *(FSDPUnit(b) for b in model.layers.values()),
                 FSDPUnit([model.norm, model.output], reshard_after_forward=False)]
        apply_fsdp(units, model, meshes, job_config.training.dtype, job_config.training.mixed_precision_reduce,
                   reshard_after_forward=True)
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
    flavors=FLAVORS,
    build_args=build_args,
    parallelize_fn=parallelize,
    build_loss_fn=lambda args: cross_entropy_sum,
    post_optimizer_step=lambda model_parts, job_config, dp_group: {},
    counts=counts,
    recompute_modules=RECOMPUTE_MODULES,
)


def register() -> None:
    """Make `model.name = "toy_dense"` available (a package under models/ would register on import)."""
    register_model_spec(SPEC)
