"""Activation checkpointing (AC) of the transformer blocks: what forward keeps, what backward recomputes.

`apply_ac(layers, ac_cfg, recompute_modules)` applies the `[activation_checkpoint]` section to the blocks in
`layers` (a ModuleDict keyed by the global layer id), which the model's parallelize plan hands in together with its
recompute-name table (models/deepseek_v3/parallelize.py for DeepSeek-V3):

    none                          nothing changes
    full                          every block keeps only its input and recomputes everything in backward (an EP
                                  block also keeps its split sizes: no second host sync, see below)
    selective, granularity=layer  every `layer_freq`-th block (by global layer id) is checkpointed fully
    selective, granularity=op     per-op selective checkpointing (SAC) of every block, as data:
        save_ops                  OP_TABLE names whose outputs are saved; every other op is recomputed
        force_recompute_modules   submodules (dotted FQN suffixes inside a block) whose ops are recomputed even
                                  when their op is in save_ops
    selective, granularity=op, recompute_modules set (Megatron-Core names, the model's `RecomputeTable`)
                                  only the submodules the names cover (and force_recompute_modules) are
                                  checkpointed; the rest of the block keeps what autograd keeps without AC.
                                  Inside such a submodule the covered ops are recomputed and the others follow
                                  save_ops, so a GEMM next to a recomputed activation is not recomputed.

Blocks are wrapped in `checkpoint_wrapper` (state_dict keys unchanged, attribute access forwarded). The
submodules of recompute_modules get torch's composable `checkpoint` instead, which adds hooks but no wrapper, so
their FQNs and attributes (and assignments to them) stay untouched.

Two rules hold in every selective policy, whatever the lists say (and full AC of an EP block keeps the first
one and the integer all-to-all of the split sizes):
  * device-to-host copies (the EP split sizes' `.tolist()`, `.item()`) are saved, so recompute never syncs again;
  * collectives named in save_ops stay saved inside recomputed modules, so a module-level recompute never
    communicates again (the EP split-size exchange must not run twice).

"Inside a module" is known from forward pre/post hooks on the matched submodules, not from tensor shapes. The
hooks write into a per-pass state that each checkpointed forward and each recompute creates afresh, so a recompute
(which runs the module forwards, and so the hooks, again), an early-stopped recompute or an exception never leaves
a stale "inside" mark for the next pass. Under torch.compile (of a block, after `apply_ac`) no hook runs while the
region is traced; the policy reads the module stack each traced node records instead. recompute_modules cannot
be compiled (the composable checkpoint's hooks break the trace); `ac_config_problem` rejects that combination.

SAC caches the saved outputs per op in call order and hands them back by position during recompute, so a block
must dispatch the same sequence of each saved op in forward and in recompute. FSDP's runtime inside a region (the
all-gather of experts sharded on their own mesh) differs between the two passes by design; `_RuntimeBypass` keeps
it out of SAC's bookkeeping (docs/activation_checkpointing.md, "Why AC crashed on FSDP-sharded experts").
Work that runs in forward only (statistics guarded by `models.common.recompute.in_recompute`) must therefore not use
an op that a policy saves (`_to_copy` included: d2h copies are saved). Process-wide state (comm buffers) must be
created before the first forward, outside any checkpointed region: ops run while creating it would enter the SAC
cache.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from models.common.token_dispatch import TokenDispatcher
from parallelisms.moe_comm.registry import COMM_BACKENDS, backend_save_ops, on_register
from trainer.config import option


@dataclasses.dataclass
class ActivationCheckpointSection:
    """Activation checkpointing: what to keep from forward and what to recompute in backward."""

    mode: str = option("none", choices=["none", "full", "selective"])
    """none keeps all activations, full recomputes whole blocks, selective follows the knobs below."""
    granularity: str = option("op", choices=["op", "layer"])
    """With selective mode: op saves the outputs of save_ops and recomputes the rest; layer checkpoints
    every layer_freq-th block fully."""
    layer_freq: int = option(2, ge=1)
    """With granularity=layer, checkpoint every n-th block."""
    save_ops: list[str] = dataclasses.field(default_factory=lambda: [
        "mm", "grouped_mm", "attention", "all_to_all", "reduce_scatter", "max", "topk", *backend_save_ops(),
        "d2h_copy"])
    """Op names whose outputs selective op-level checkpointing saves instead of recomputing (expensive
    compute, collectives, the registered comm backends' dispatch/combine ops and host copies)."""
    force_recompute_modules: list[str] = option(["moe.router.gate"])
    """Module names whose matmuls are recomputed even though mm is in save_ops."""
    recompute_modules: list[str] = option([])
    """Megatron-style names of submodules to recompute (e.g. core_attn, moe_act, mla_up_proj)."""
    early_stop: bool = False
    """Stop recomputation once every needed tensor is rebuilt; off because it leaked memory together with
    EP all-to-all (torchtitan #1467)."""


__all__ = [
    "COLLECTIVE_OPS",
    "OP_TABLE",
    "OpCounter",
    "OpRef",
    "RecomputeTable",
    "ScopeRule",
    "ac_config_problem",
    "apply_ac",
    "op_kind",
    "resolve_ops",
    "save_ops_warning",
]

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------- the op table

@dataclasses.dataclass(frozen=True)
class OpRef:
    """One op by qualified name (`namespace.op.overload`), resolved lazily, optionally only when `when` holds.

    Lazy resolution lets the table name ops that a torch build or a library may lack: an op whose namespace is
    not registered resolves to None and has no effect. `when(args, kwargs)` narrows an op to some calls.
    """

    name: str
    when: Callable[[tuple, dict], bool] | None = None

    def resolve(self) -> torch._ops.OpOverload | None:
        """The OpOverload, or None while its library is not registered."""
        namespace, op, overload = self.name.split(".")
        try:
            return getattr(getattr(getattr(torch.ops, namespace), op), overload)
        except (AttributeError, RuntimeError):
            return None


def _off_host(args: tuple, kwargs: dict) -> bool:
    """The first argument is a tensor off the CPU (`.item()` of it is a device-to-host sync)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"


def _to_host(args: tuple, kwargs: dict) -> bool:
    """`_to_copy(x, device=cpu)`: a copy into host memory (`.cpu()`, `.to("cpu")`, `.tolist()` off the CPU).

    A CPU tensor's `.cpu()` dispatches nothing, so on CPU this matches only explicit copies
    (`.to("cpu", copy=True)`, `models.common.token_dispatch.host_list`): the dispatchers' syncs, as on a GPU.
    """
    dst = kwargs.get("device")
    return dst is not None and torch.device(dst).type == "cpu"


_SDPA = "aten._scaled_dot_product"

#: Short op names usable in `save_ops`, and the ops (resolved lazily) they stand for. Each registered MoE comm
#: backend adds its own ops (`TokenDispatcher.ac_ops`) when it registers.
OP_TABLE: dict[str, tuple[OpRef, ...]] = {
    # aten.linear is composite and reaches the dispatcher as mm/addmm in eager; listed for traced graphs.
    # FP8 GEMMs (parallelisms/fp8.py, torchao) count as their matmul kind.
    "mm": (OpRef("aten.mm.default"), OpRef("aten.addmm.default"), OpRef("aten.bmm.default"),
           OpRef("aten.linear.default"), OpRef("aten._scaled_mm.default")),
    "grouped_mm": (OpRef("aten._grouped_mm.default"), OpRef("aten._scaled_grouped_mm.default")),
    # Fused SDPA kernels. MLA's q/k head dim differs from v's, which the CPU flash kernel rejects: on CPU the model
    # pads v for flash in bf16 and takes the math path in fp32 (bmm and softmax: "mm" and "softmax").
    "attention": (OpRef(f"{_SDPA}_flash_attention_for_cpu.default"), OpRef(f"{_SDPA}_flash_attention.default"),
                  OpRef(f"{_SDPA}_efficient_attention.default"), OpRef(f"{_SDPA}_cudnn_attention.default"),
                  OpRef("aten._flash_attention_forward.default"), OpRef("aten._efficient_attention_forward.default")),
    "softmax": (OpRef("aten._softmax.default"), OpRef("aten._safe_softmax.default")),
    "all_to_all": (OpRef("_c10d_functional.all_to_all_single.default"),),
    "reduce_scatter": (OpRef("_c10d_functional.reduce_scatter_tensor.default"),),
    "all_gather": (OpRef("_c10d_functional.all_gather_into_tensor.default"),),
    "max": (OpRef("aten.max.default"), OpRef("aten.max.dim"), OpRef("aten.amax.default")),
    "topk": (OpRef("aten.topk.default"),),
    # Saved by every selective policy whether listed or not (see the module docstring).
    "d2h_copy": (OpRef("aten._to_copy.default", when=_to_host),
                 OpRef("aten._local_scalar_dense.default", when=_off_host)),
    "silu": (OpRef("aten.silu.default"),),
    "mul": (OpRef("aten.mul.Tensor"),),
    # The fused RMSNorm kernel (CUDA); on CPU nn.RMSNorm decomposes into pow/mean/rsqrt/mul and this is a no-op.
    "norm": (OpRef("aten._fused_rms_norm.default"),),
}

#: Save-list names that communicate: kept saved even inside recomputed modules (comm backends add theirs).
COLLECTIVE_OPS = {"all_to_all", "reduce_scatter", "all_gather"}


@dataclasses.dataclass(frozen=True)
class ScopeRule:
    """Recompute the ops that run inside the block submodules whose FQN ends with `module`.

    kinds: OP_TABLE names the rule is restricted to (None = every op of the module).
    direct_only: only ops the module's own forward runs, not those of its child modules.
    """

    module: str
    kinds: tuple[str, ...] | None = None
    direct_only: bool = False


RecomputeTable = Mapping[str, Sequence[ScopeRule]]
"""A model's `recompute_modules` names (Megatron-Core style, e.g. "core_attn") and the scope rules each stands for,
with the model's own submodule names; the model's parallelize plan hands it in."""


def resolve_ops(name: str) -> list[torch._ops.OpOverload]:
    """The registered ops of OP_TABLE entry `name` (unregistered ones are left out); ValueError if unknown."""
    if name not in OP_TABLE:
        raise ValueError(f"unknown op name {name!r}; valid names: {', '.join(OP_TABLE)}")
    return [op for op in (ref.resolve() for ref in OP_TABLE[name]) if op is not None]


_KindIndex = dict[torch._ops.OpOverload, list[tuple[str, Callable | None]]]


def _kind_index() -> _KindIndex:
    index: _KindIndex = collections.defaultdict(list)
    for name, refs in OP_TABLE.items():
        for ref in refs:
            op = ref.resolve()
            if op is not None:
                index[op].append((name, ref.when))
    return dict(index)


# op -> OP_TABLE names, built once: `op_kind` runs for every op of every EP block under full AC (forward and
# recompute), where resolving the whole table per call was costly (docs/activation_checkpointing.md). Rebuilt when
# a comm backend adds its ops.
_INDEX: _KindIndex = _kind_index()


def _add_backend_ops(backend: type[TokenDispatcher]) -> None:
    """Registry listener: put a comm backend's ops in OP_TABLE (as collectives) and rebuild the index."""
    global _INDEX
    taken = [name for name in backend.ac_ops if name in OP_TABLE]
    if taken:
        raise ValueError(f"{backend.__qualname__}.ac_ops: {', '.join(taken)} already in the activation "
                         "checkpointing op table")
    for name, qualified in backend.ac_ops.items():
        OP_TABLE[name] = tuple(OpRef(q) for q in qualified)
        COLLECTIVE_OPS.add(name)
    _INDEX = _kind_index()


on_register(_add_backend_ops)


def _kind_in(index, op, args: tuple, kwargs: dict) -> str | None:
    for name, when in index.get(op, ()):
        if when is None or when(args, kwargs):
            return name
    return None


def op_kind(op: torch._ops.OpOverload, args: tuple = (), kwargs: dict | None = None) -> str | None:
    """The OP_TABLE name that `op` called with args/kwargs falls under, or None."""
    return _kind_in(_INDEX, op, args, kwargs or {})


def _name_problem(ac_cfg, recompute_modules: RecomputeTable | None) -> tuple[str, str, str] | None:
    """An unknown name in save_ops or recompute_modules as (key, problem, allowed values), or None.

    recompute_modules: the model's table; None leaves those names unchecked (no model known yet)."""
    for name in ac_cfg.save_ops:
        if name not in OP_TABLE:
            return "activation_checkpoint.save_ops", f"unknown op name {name!r}", ", ".join(OP_TABLE)
    for name in ac_cfg.recompute_modules if recompute_modules is not None else ():
        if name not in recompute_modules:
            return ("activation_checkpoint.recompute_modules", f"unknown module name {name!r}",
                    ", ".join(recompute_modules))
    return None


_SELECTIVE_OP = 'mode = "selective" and granularity = "op"'
#: The settings that only some modes read: key -> (where it is read, in words; whether (mode, granularity) reads it).
_READ_ONLY_IN: dict[str, tuple[str, Callable[[str, str], bool]]] = {
    "granularity": ('mode = "selective"', lambda mode, granularity: mode == "selective"),
    "layer_freq": ('mode = "selective" and granularity = "layer"',
                   lambda mode, granularity: (mode, granularity) == ("selective", "layer")),
    "save_ops": (_SELECTIVE_OP, lambda mode, granularity: (mode, granularity) == ("selective", "op")),
    "force_recompute_modules": (_SELECTIVE_OP, lambda mode, granularity: (mode, granularity) == ("selective", "op")),
    "recompute_modules": (_SELECTIVE_OP, lambda mode, granularity: (mode, granularity) == ("selective", "op")),
    "early_stop": ('mode = "full" or "selective"', lambda mode, granularity: mode != "none"),
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


def ac_config_problem(ac_cfg, recompute_modules: RecomputeTable | None,
                      compile_model: bool = False) -> tuple[str, str, str] | None:
    """The first mistake in the AC section as (key, problem, allowed values), or None.

    Checks what needs no built model: op names, recompute_modules names against the model's table
    `recompute_modules` (None: not checked), that no setting differs from its default where
    the chosen mode would ignore it (save_ops without the selective per-op mode, say), and that recompute_modules
    does not come with a compiled model (`compile_model`): torch.compile cannot trace the hook-based composable
    checkpoint those names use. Names in force_recompute_modules depend on the model; `apply_ac` looks them up.
    """
    problem = _name_problem(ac_cfg, recompute_modules) or _ignored_setting(ac_cfg)
    if problem is not None:
        return problem
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

    Only a list that differs from the default is judged: the default names ops for every device and layout, and
    those of other devices cost nothing. Modes that do not read save_ops are left to `ac_config_problem`.
    """
    if (ac_cfg.mode, ac_cfg.granularity) != ("selective", "op") or ac_cfg.save_ops == type(ac_cfg)().save_ops:
        return None
    inert = _inert_save_ops(ac_cfg.save_ops, device_type, dtype, ep_degree, comm_backend)
    if not inert:
        return None
    line = "activation_checkpoint.save_ops: " + "; ".join(f"{name!r} saves nothing here ({why})" for name, why in inert)
    effective = set(ac_cfg.save_ops) - {name for name, _ in inert} - {"d2h_copy"}  # d2h copies are always saved
    if not effective and not ac_cfg.recompute_modules:
        line += ('; nothing else in save_ops is saved, so every op is recomputed as with mode = "full", at the '
                 "higher cost of the selective policy")
    return line


# ----------------------------------------------------------------------------------------------- scope tracking

def _matches(fqn: str, pattern: str) -> bool:
    return fqn == pattern or fqn.endswith("." + pattern)


def _join(prefix: str, fqn: str) -> str:
    return ".".join(p for p in (prefix, fqn) if p)


@dataclasses.dataclass
class _PassState:
    """Which hooked submodules are running in one forward or recompute pass of one checkpointed module."""

    stack: list[str] = dataclasses.field(default_factory=list)
    entered: set[str] = dataclasses.field(default_factory=set)


class _ScopeTracker:
    """Hooks on the rule modules under `root` (a block, or a submodule at block-relative `prefix`).

    Targets are FQNs relative to root; "" stands for root itself, whose ops are all inside. The state lives per
    pass and per thread: `begin()` installs a fresh one for a checkpointed forward or recompute, and hooks firing
    outside such a pass (evaluation under no_grad) do nothing.
    """

    def __init__(self, root: nn.Module, prefix: str, rules: Sequence[ScopeRule]):
        modules = dict(root.named_modules())
        self._local = threading.local()
        self.rules: list[tuple[frozenset[str], bool, tuple[str, ...] | None]] = []
        hooked: set[str] = set()
        for rule in rules:
            targets = frozenset(f for f in modules if _matches(_join(prefix, f), rule.module))
            if not targets:
                continue
            self.rules.append((targets, rule.direct_only, rule.kinds))
            hooked |= targets
            if rule.direct_only:
                # children are hooked too, so that the innermost running module tells "itself" from "a child"
                hooked |= {_join(t, child) for t in targets for child, _ in modules[t].named_children()}
        hooked.discard("")  # root runs for the whole pass; hooking it would race the checkpoint's own hooks
        self.targets = frozenset().union(*(targets for targets, _, _ in self.rules)) - {""}
        self.prefix = prefix
        self._by_id = {id(modules[fqn]): fqn for fqn in hooked}
        for fqn in sorted(hooked):
            modules[fqn].register_forward_pre_hook(functools.partial(self._enter, fqn))
            modules[fqn].register_forward_hook(functools.partial(self._exit, fqn), always_call=True)

    def _enter(self, fqn: str, module, args) -> None:
        state = getattr(self._local, "state", None)
        if state is not None:
            state.stack.append(fqn)
            state.entered.add(fqn)

    def _exit(self, fqn: str, module, args, output) -> None:
        state = getattr(self._local, "state", None)
        if state is not None and state.stack and state.stack[-1] == fqn:
            state.stack.pop()

    def running(self) -> list[str]:
        """Root-relative FQNs of the hooked modules running now, outermost first ("" = root)."""
        if fx_traceback.has_preserved_node_meta():
            # Under torch.compile the policy runs while a graph is traced: each node carries the stack of modules
            # it came from, keyed by the module's id (torch 2.13).
            traced = fx_traceback.current_meta.get("nn_module_stack") or {}
            return [""] + [self._by_id[int(key)] for key in traced if key.isdigit() and int(key) in self._by_id]
        state = getattr(self._local, "state", None)
        return [""] + (state.stack if state is not None else [])

    def begin(self) -> _PassState | None:
        previous = getattr(self._local, "state", None)
        self._local.state = _PassState()
        return previous

    def end(self, previous: _PassState | None, check_entered: bool) -> None:
        state = getattr(self._local, "state", None)
        self._local.state = previous
        if check_entered and state is not None:
            for fqn in sorted(self.targets - state.entered):
                # A submodule whose forward is never called (its parent uses only its weights) cannot be
                # scoped by hooks: say so (Python shows a given warning once) instead of recomputing nothing.
                warnings.warn(f"activation checkpointing: {_join(self.prefix, fqn)!r} never ran its forward "
                              "inside its block, so its recompute rule has no effect (its parent uses only its "
                              "parameters)", RuntimeWarning)


# ----------------------------------------------------------------------------------------------- SAC passes

_RECORD_ENTER = torch.ops.profiler._record_function_enter_new.default
_RECORD_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


class _RuntimeBypass(TorchDispatchMode):
    """Keeps FSDP's runtime out of SAC's replay: entered directly on top of one pass's SAC mode.

    SAC replays a region by counting each op: the n-th call of an op in the recompute gets what the n-th call in
    forward saved, and an op the forward never ran is an error. That holds for the model's computation, not for
    FSDP's runtime, whose work inside a region depends on the unshard state: a module sharded on its own inside a
    checkpointed block (the routed experts under EP, on the experts mesh) has its all-gather issued in forward by
    the previous unit's prefetch, outside the region, but in the recompute by its own pre-forward hook, inside it
    (nothing prefetches it there: it was resharded after forward). So the recompute runs ops the forward never
    ran (`fsdp.all_gather_copy_in`, the bf16 copy-in's splits) and SAC refuses the replay.

    FSDP labels all its runtime with `record_function("FSDP::...")`. Ops dispatched inside such a range, and the
    profiler markers themselves, skip the SAC mode below (the modes under it, e.g. the memory tracker, still see
    them): they run in both passes as FSDP decides, and neither saves nor counts them. The model's ops are
    replayed exactly as before; what the policy saves is unchanged. (pytorch/pytorch#196862 proposes the same
    bypass inside FSDP.)
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Like the SAC modes: compiled pieces inside the region (EP blocks compile their parts) run as one op."""
        return True

    def __init__(self, sac_mode: TorchDispatchMode):
        super().__init__()
        self._sac_mode = sac_mode
        self._open = 0  # record_function ranges open in this pass
        self._runtime_from: int | None = None  # how many were open when an FSDP range opened

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _RECORD_ENTER:
            if self._runtime_from is None and str(args[0]).startswith("FSDP::"):
                self._runtime_from = self._open
            self._open += 1
            return self._skip_sac(func, args, kwargs)
        if func is _RECORD_EXIT:
            self._open -= 1
            if self._runtime_from == self._open:
                self._runtime_from = None
            return self._skip_sac(func, args, kwargs)
        if self._runtime_from is not None:
            return self._skip_sac(func, args, kwargs)
        return func(*args, **kwargs)

    def _skip_sac(self, func, args, kwargs):
        with _pop_mode_temporarily() as below:
            if below is not self._sac_mode:
                raise RuntimeError("activation checkpointing: a dispatch mode was entered between the SAC mode and "
                                   "its FSDP bypass")
            return func(*args, **kwargs)


class _SACPass:
    """One pass (forward or recompute) of a SAC region: its SAC mode with a fresh `_RuntimeBypass` on top, and
    optionally a fresh scope state of `tracker` around both."""

    def __init__(self, mode: TorchDispatchMode, tracker: _ScopeTracker | None = None, is_forward: bool = False):
        self._mode = mode
        self._tracker = tracker
        self._is_forward = is_forward
        self._bypass: _RuntimeBypass | None = None
        self._previous: _PassState | None = None

    def __enter__(self):
        if self._tracker is not None:
            self._previous = self._tracker.begin()
        self._mode.__enter__()
        self._bypass = _RuntimeBypass(self._mode)
        self._bypass.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self._bypass.__exit__(exc_type, exc, tb)
            return self._mode.__exit__(exc_type, exc, tb)
        finally:
            if self._tracker is not None:
                self._tracker.end(self._previous, check_entered=self._is_forward and exc_type is None)


def _sac_contexts(policy_fn: Callable[..., CheckpointPolicy],
                 tracker: _ScopeTracker | None = None) -> tuple[_SACPass, _SACPass]:
    """`torch.utils.checkpoint` contexts for `policy_fn` in eager mode: torch's SAC modes (fresh storage per call),
    each with the FSDP runtime bypass, and with `tracker`'s per-pass scope state when given."""
    fwd_mode, recompute_mode = create_selective_checkpoint_contexts(policy_fn)
    return _SACPass(fwd_mode, tracker, True), _SACPass(recompute_mode, tracker, False)


# ----------------------------------------------------------------------------------------------- the SAC policy

class _SelectivePolicy:
    """The per-op decision inside one checkpointed module, in this order:

    d2h copy -> save; collective listed in save_ops -> save; inside a recompute scope -> recompute;
    in save_ops -> save; anything else -> recompute.
    """

    def __init__(self, save_ops: Sequence[str], tracker: _ScopeTracker):
        self.save_names = tuple(save_ops)
        self.tracker = tracker
        self._resolve()

    def _resolve(self) -> None:
        """Resolve the op names; repeated per forward, so that a comm backend registered later takes effect."""
        # op -> the conditions under which it counts as saved (None: always); `_to_copy` is saved only as a host
        # copy, never as a dtype cast
        self.save: dict[torch._ops.OpOverload, list[Callable | None]] = collections.defaultdict(list)
        for name in self.save_names:
            for ref in OP_TABLE[name]:
                op = ref.resolve()
                if op is not None:
                    self.save[op].append(ref.when)
        self.pinned = frozenset(op for name in self.save_names if name in COLLECTIVE_OPS for op in resolve_ops(name))
        self.host_copies = {ref.resolve(): ref.when for ref in OP_TABLE["d2h_copy"]}
        self.rule_ops = [
            (targets, direct, None if kinds is None else frozenset(op for k in kinds for op in resolve_ops(k)))
            for targets, direct, kinds in self.tracker.rules
        ]

    def context_fn(self) -> Callable[[], tuple[Any, Any]]:
        """`context_fn` for `torch.utils.checkpoint` (a partial: the form torch.compile accepts)."""
        return functools.partial(_pass_contexts, self)

    def _in_recompute_scope(self, op) -> bool:
        if not self.rule_ops:
            return False
        running = self.tracker.running()
        for targets, direct, ops in self.rule_ops:
            inside = running[-1] in targets if direct else any(f in targets for f in running)
            if inside and (ops is None or op in ops):
                return True
        return False

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        when = self.host_copies.get(op)
        if when is not None and when(args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if op in self.pinned:
            return CheckpointPolicy.MUST_SAVE
        if self._in_recompute_scope(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if any(when is None or when(args, kwargs) for when in self.save.get(op, ())):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _pass_contexts(policy: _SelectivePolicy) -> tuple[Any, Any]:
    """A fresh SAC cache and scope state per checkpointed call: (forward context, recompute context)."""
    policy._resolve()
    if fx_traceback.has_preserved_node_meta():
        # torch.compile runs the region as a graph (it insists on bare dispatch modes then): module hooks do not
        # fire, so the policy reads each node's module stack instead (`_ScopeTracker.running`). FSDP's hooks
        # are dynamo-disabled and never inside such a graph.
        return create_selective_checkpoint_contexts(policy)
    return _sac_contexts(policy, policy.tracker)


# ----------------------------------------------------------------------------------------------- apply

def _check_force_modules(blocks: Iterable[nn.Module], names: Sequence[str]) -> None:
    fqns = sorted({f for block in blocks for f, _ in block.named_modules() if f})
    for name in names:
        if not any(_matches(f, name) for f in fqns):
            # Not an error: a pipeline stage may hold no block with that module (only dense layers, say).
            logger.warning("activation_checkpoint.force_recompute_modules: %r matches no module inside the blocks "
                           "of this model part; names there: %s", name, ", ".join(fqns))


def _covering_modules(block: nn.Module, rules: Sequence[ScopeRule]) -> list[str]:
    """Block-relative FQNs to checkpoint for `rules`: every match, minus those inside another match."""
    matched = {f for f, _ in block.named_modules() if f and any(_matches(f, r.module) for r in rules)}
    return sorted(f for f in matched if not any(f.startswith(other + ".") for other in matched))


def _syncs_with_host(block: nn.Module) -> bool:
    """Whether an MoE of `block` routes through a communicating dispatcher (EP), which syncs split sizes."""
    return any(not m.dispatcher.traceable for m in block.modules()
               if isinstance(getattr(m, "dispatcher", None), TokenDispatcher))


def _routing_metadata_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Full AC of an EP block: recompute everything but the host copies and the integer all-to-alls.

    Those are the split sizes (a few ints per rank): saving them keeps EP at one host sync per MoE layer and
    step, where a plain full checkpoint would exchange and sync them again in backward. Token rows (floating
    point) are recomputed, communication included, like any other activation of a fully checkpointed block.
    """
    kind = op_kind(op, args, kwargs)
    if kind == "d2h_copy" or (kind == "all_to_all" and not args[0].is_floating_point()):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep_routing_metadata():
    """context_fn of full AC for EP blocks (see `_routing_metadata_policy`)."""
    return _sac_contexts(_routing_metadata_policy)


def apply_ac(layers: nn.ModuleDict, ac_cfg, recompute_modules: RecomputeTable) -> None:
    """Apply the `[activation_checkpoint]` section `ac_cfg` to the blocks in `layers` (keyed by global layer id)
    in place, with the model's recompute-name table `recompute_modules`.

    Call it after expert parallelism (the dispatcher must be in place) and before compile and FSDP. Blocks become
    `CheckpointWrapper`s: attribute access is forwarded and state_dict keys are unchanged, but
    `named_parameters()` shows a `_checkpoint_wrapped_module.` component.
    """
    # Names only: a caller may vary the mode over one section (benchmarks/ac_sweep.py) and leave the settings of
    # the other modes in it; validate_job rejects such a section in a job.
    problem = _name_problem(ac_cfg, recompute_modules)
    if problem is not None:
        key, what, allowed = problem
        raise ValueError(f"{key}: {what}; allowed: {allowed}")
    if ac_cfg.mode == "none":
        return
    wrapper_kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT, "preserve_rng_state": True,
                                      "early_stop": ac_cfg.early_stop}
    if ac_cfg.mode == "full":
        for name, block in list(layers.items()):
            extra = {"context_fn": _keep_routing_metadata} if _syncs_with_host(block) else {}
            layers[name] = checkpoint_wrapper(block, **wrapper_kwargs, **extra)
        return
    if ac_cfg.granularity == "layer":
        for name, block in list(layers.items()):
            # layer ids are global (pipeline stages keep them), so the choice does not depend on the PP split
            if (int(name) + 1) % ac_cfg.layer_freq == 0:
                layers[name] = checkpoint_wrapper(block, **wrapper_kwargs)
        return

    _check_force_modules(layers.values(), ac_cfg.force_recompute_modules)
    rules = [ScopeRule(name) for name in ac_cfg.force_recompute_modules]
    if not ac_cfg.recompute_modules:
        for name, block in list(layers.items()):
            policy = _SelectivePolicy(ac_cfg.save_ops, _ScopeTracker(block, "", rules))
            layers[name] = checkpoint_wrapper(block, context_fn=policy.context_fn(), **wrapper_kwargs)
        return

    rules += [rule for name in ac_cfg.recompute_modules for rule in recompute_modules[name]]
    for block in layers.values():
        for fqn in _covering_modules(block, rules):
            module = block.get_submodule(fqn)
            policy = _SelectivePolicy(ac_cfg.save_ops, _ScopeTracker(module, fqn, rules))
            composable_checkpoint(module, context_fn=policy.context_fn(), preserve_rng_state=True,
                                  early_stop=ac_cfg.early_stop)


# ----------------------------------------------------------------------------------------------- measurement

class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active: by overload (`counts["aten.mm.default"]`) and by OP_TABLE name
    (`kinds["mm"]`, "other" for the rest).

    What a backward recomputes is the difference between the counts of the same backward with and without AC.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counts[str(func)] += 1
        self.kinds[op_kind(func, args, kwargs) or "other"] += 1
        return func(*args, **kwargs)
