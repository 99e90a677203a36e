"""The `[activation_checkpoint]` section and what can be checked of it before a model exists: names against the op
table and the model's recompute table, settings the chosen mode would ignore, and save_ops that save nothing on
this device, dtype and comm backend (a warning, not an error), and the per-layer choice of mode budget as text."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence

from core.config import option
from core.names import DEFAULT
from parallelisms.activation_checkpoint.budget import parse_per_layer
from parallelisms.moe_comm.registry import COMM_BACKENDS, op_table

__all__ = ["ActivationCheckpointSection", "ac_config_problem", "name_problem", "save_ops_warning"]


@dataclasses.dataclass
class ActivationCheckpointSection:
    """Activation checkpointing: what to keep from forward and what to recompute in backward."""

    mode: str = option("none", choices=["none", "full", "selective", "budget"])
    """none keeps all activations, full recomputes whole blocks, selective follows the knobs below, budget chooses
    per block before launch (no AC, full, or the ops to save) so that the planned peak fits memory_budget_gib at
    the least predicted recompute time."""
    granularity: str = option("op", choices=["op", "layer"])
    """With selective mode: op saves the outputs of save_ops and recomputes the rest; layer checkpoints
    every layer_freq-th block fully."""
    layer_freq: int = option(2, ge=1)
    """With granularity=layer, checkpoint every n-th block."""
    save_ops: list[str] = option([DEFAULT])
    """Op names whose outputs selective op-level checkpointing saves instead of recomputing; "default" = the
    expensive compute, the collectives, the registered comm backends' own ops and host copies (mm, grouped_mm,
    attention, all_to_all, reduce_scatter, max, topk, each backend's dispatch and combine, d2h_copy), and may be
    combined with more names (default, softmax)."""
    force_recompute_modules: list[str] = option([DEFAULT])
    """Modules inside the blocks (names or dotted parts of their block-relative names) whose ops are recomputed
    even though save_ops names them; "default" = the model's list (DeepSeek-V3: moe.router.gate)."""
    recompute_modules: list[str] = option([])
    """Megatron-style names of submodules to recompute (e.g. core_attn, moe_act, mla_up_proj)."""
    memory_budget_gib: float = option(0.0, ge=0)
    """With mode budget: the most a rank may hold at its planned peak, in GiB (the memory plan's worst rank: every
    pipeline stage, expert rows at the planner's routing skew, the comm backend's buffers); 0 = the device's memory
    per rank less the layout planner's 10% reserve."""
    per_layer: list[str] = option([])
    """With mode budget: the choice per block, one entry per layer: 3=none, 3=full, or 3=mm+grouped_mm (the ops
    whose outputs are saved; the rest is recomputed). Empty = chosen before launch, and the run's merged config
    shows the choice; set (e.g. from a printed config) = used as given."""
    early_stop: bool = False
    """Stop recomputation once every needed tensor is rebuilt; off because it leaked memory together with
    EP all-to-all (torchtitan #1467)."""


def name_problem(ac_cfg, recompute_modules: Mapping[str, object] | None) -> tuple[str, str, str] | None:
    """An unknown name in save_ops or recompute_modules as (key, problem, allowed values), or None.

    recompute_modules: the model's table; None leaves those names unchecked (no model known yet)."""
    table = op_table()
    for name in ac_cfg.save_ops:
        if name != DEFAULT and name not in table:
            return ("activation_checkpoint.save_ops", f"unknown op name {name!r}",
                    ", ".join([DEFAULT, *table.ops]))
    for name in ac_cfg.recompute_modules if recompute_modules is not None else ():
        if name not in recompute_modules:
            return ("activation_checkpoint.recompute_modules", f"unknown module name {name!r}",
                    ", ".join(recompute_modules))
    return None


_SELECTIVE_OP = 'mode = "selective" and granularity = "op"'
_BUDGET = 'mode = "budget"'
#: The settings that only some modes read: key -> (where it is read, in words; whether (mode, granularity) reads it).
_READ_ONLY_IN: dict[str, tuple[str, Callable[[str, str], bool]]] = {
    "granularity": ('mode = "selective"', lambda mode, granularity: mode == "selective"),
    "layer_freq": ('mode = "selective" and granularity = "layer"',
                   lambda mode, granularity: (mode, granularity) == ("selective", "layer")),
    "save_ops": (_SELECTIVE_OP, lambda mode, granularity: (mode, granularity) == ("selective", "op")),
    "force_recompute_modules": (f"{_SELECTIVE_OP}, or {_BUDGET}", lambda mode, granularity: mode == "budget" or (
        mode, granularity) == ("selective", "op")),
    "recompute_modules": (_SELECTIVE_OP, lambda mode, granularity: (mode, granularity) == ("selective", "op")),
    "memory_budget_gib": (_BUDGET, lambda mode, granularity: mode == "budget"),
    "per_layer": (_BUDGET, lambda mode, granularity: mode == "budget"),
    "early_stop": ('mode = "full", "selective" or "budget"', lambda mode, granularity: mode != "none"),
}


def _ignored_setting(ac_cfg) -> tuple[str, str, str] | None:
    """A setting changed from its default that the chosen mode never reads, as (key, problem, allowed values)."""
    defaults = type(ac_cfg)()
    for name, (where, reads) in _READ_ONLY_IN.items():
        value, default = getattr(ac_cfg, name), getattr(defaults, name)
        if value != default and not reads(ac_cfg.mode, ac_cfg.granularity):
            shown = "the default list" if isinstance(default, list) and default else json.dumps(default)
            return (f"activation_checkpoint.{name}",
                    f"set, but mode={ac_cfg.mode!r} granularity={ac_cfg.granularity!r} would ignore it",
                    f"{shown} unless {where}")
    return None


def ac_config_problem(ac_cfg, recompute_modules: Mapping[str, object] | None,
                      compile_model: bool = False) -> tuple[str, str, str] | None:
    """The first mistake in the AC section as (key, problem, allowed values), or None.

    Checks what needs no built model: op names, recompute_modules names against the model's table
    `recompute_modules` (None: not checked), that no setting differs from its default where
    the chosen mode would ignore it (save_ops without the selective per-op mode, say), and that recompute_modules
    does not come with a compiled model (`compile_model`): torch.compile cannot trace the hook-based composable
    checkpoint those names use, and the form of the per_layer entries (which layers they must name depends on
    the model: `trainer.tools.plan.resolve_ac_budget` checks them). Names in force_recompute_modules depend on the
    model; `apply_ac` looks them up.
    """
    problem = name_problem(ac_cfg, recompute_modules) or _ignored_setting(ac_cfg)
    if problem is not None:
        return problem
    try:
        parse_per_layer(ac_cfg.per_layer)
    except ValueError as e:
        return ("activation_checkpoint.per_layer", str(e), "entries layer=none, layer=full or layer=op+op with "
                f"op names from: {', '.join(n for n in op_table().ops if n != 'd2h_copy')}")
    if ac_cfg.recompute_modules and compile_model:
        return ("activation_checkpoint.recompute_modules", "set while the model is compiled (torch.compile cannot "
                "trace the per-module checkpoints)", "[] with compile, or compile.components without model")
    return None


def _inert_save_ops(save_ops: Sequence[str], device_type: str, dtype: str, ep_degree: int,
                    comm_backend: str) -> list[tuple[str, str]]:
    """(name, why) for each name in `save_ops` that no op of a run with these settings dispatches.

    Only what the device, the compute dtype and the EP setup decide; ops whose use depends on the model (max,
    softmax) or on a future layout (reduce_scatter, all_gather) are not judged.
    """
    reasons = {}
    if device_type == "cpu" and dtype == "float32":
        # A model whose v head dim differs from q/k's (MLA) pads v for the CPU flash kernel only in bf16/fp16;
        # tests/test_activation_checkpoint.py checks this rule against DeepSeek-V3.
        reasons["attention"] = ("on CPU in float32 attention takes SDPA's math path: its bmm count as 'mm' and its "
                                "softmax as 'softmax', no fused attention op runs")
    if device_type == "cpu":
        reasons["norm"] = "on CPU nn.RMSNorm decomposes into pow/mean/rsqrt/mul; the fused kernel is CUDA's"
    chosen = COMM_BACKENDS.get(comm_backend)
    if ep_degree == 1:
        reasons["all_to_all"] = "no expert parallelism (parallelism.expert_parallel_degree = 1) exchanges no tokens"
    elif chosen is not None and not chosen.uses_all_to_all:
        reasons["all_to_all"] = (f"the {comm_backend!r} comm backend moves the tokens with its own ops "
                                 f"({' / '.join(chosen.ac_ops)}), not all_to_all")
    for backend, cls in COMM_BACKENDS.items():
        if ep_degree == 1 or backend != comm_backend:
            for name in cls.ac_ops:
                reasons[name] = (f"parallelism.expert_parallel_comm_backend = {comm_backend!r} with "
                                 f"expert_parallel_degree = {ep_degree} runs no {backend!r} op")
    return [(name, reasons[name]) for name in save_ops if name in reasons]


def save_ops_warning(ac_cfg, device_type: str, dtype: str, ep_degree: int, comm_backend: str) -> str | None:
    """One warning line naming the save_ops a user set that save nothing in this run, and why; else None.

    Only the names a user writes are judged, not those "default" stands for: the default names ops for every
    device and layout, and those of other devices cost nothing. Modes that do not read save_ops are left to
    `ac_config_problem`.
    """
    if (ac_cfg.mode, ac_cfg.granularity) != ("selective", "op"):
        return None
    explicit = [name for name in ac_cfg.save_ops if name != DEFAULT]
    inert = _inert_save_ops(explicit, device_type, dtype, ep_degree, comm_backend)
    if not inert:
        return None
    line = "activation_checkpoint.save_ops: " + "; ".join(f"{name!r} saves nothing here ({why})" for name, why in inert)
    saved = op_table().save_ops(ac_cfg.save_ops)
    effective = set(saved) - {name for name, _ in inert} - {"d2h_copy"}  # d2h copies are always saved
    if not effective and not ac_cfg.recompute_modules:
        line += ('; nothing else in save_ops is saved, so every op is recomputed as with mode = "full", at the '
                 "higher cost of the selective policy")
    return line
