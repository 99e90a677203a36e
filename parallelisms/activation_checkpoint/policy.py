"""Applying activation checkpointing to a model's blocks: the scope tracker, the SAC passes with FSDP's runtime kept
out of their replay, the per-op selective policy, and `apply_ac` (see the package docstring for the modes)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from core.names import DEFAULT, denotes, resolve
from core.recompute import RecomputeMemo
from core.token_dispatch import FP8_WIRE_DTYPE, TokenDispatcher
from parallelisms.activation_checkpoint.budget import parse_per_layer
from parallelisms.activation_checkpoint.config import name_problem
from parallelisms.activation_checkpoint.ops import OpTable
from parallelisms.moe_comm.registry import op_table

__all__ = ["OpCounter", "RecomputeTable", "ScopeRule", "apply_ac", "block_module_names", "force_modules_warning",
           "user_force_modules"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ScopeRule:
    """Recompute the ops that run inside the block submodules whose FQN ends with `module`.

    kinds: op-table names the rule is restricted to (None = every op of the module).
    direct_only: only ops the module's own forward runs, not those of its child modules.
    """

    module: str
    kinds: tuple[str, ...] | None = None
    direct_only: bool = False


RecomputeTable = Mapping[str, Sequence[ScopeRule]]
"""A model's `recompute_modules` names (Megatron-Core style, e.g. "core_attn") and the scope rules each stands for,
with the model's own submodule names; the model's parallelize plan hands it in."""

# ----------------------------------------------------------------------------------------------- scope tracking

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
            targets = frozenset(f for f in modules if denotes(_join(prefix, f), rule.module))
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
    """One pass (forward or recompute) of a SAC region: its SAC mode with a fresh `_RuntimeBypass` on top, the
    call's recompute memo current (recording in the forward, replaying in the recompute), and optionally a fresh
    scope state of `tracker` around both."""

    def __init__(self, mode: TorchDispatchMode, memo: RecomputeMemo, tracker: _ScopeTracker | None = None,
                 is_forward: bool = False):
        self._mode = mode
        self._memo = memo
        self._tracker = tracker
        self._is_forward = is_forward
        self._bypass: _RuntimeBypass | None = None
        self._previous: _PassState | None = None
        self._previous_memo: tuple | None = None

    def __enter__(self):
        if self._tracker is not None:
            self._previous = self._tracker.begin()
        self._mode.__enter__()
        self._bypass = _RuntimeBypass(self._mode)
        self._bypass.__enter__()
        self._previous_memo = self._memo.activate(recording=self._is_forward)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self._bypass.__exit__(exc_type, exc, tb)
            return self._mode.__exit__(exc_type, exc, tb)
        finally:
            RecomputeMemo.deactivate(self._previous_memo)
            if self._tracker is not None:
                self._tracker.end(self._previous, check_entered=self._is_forward and exc_type is None)


_SAVED = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)
#: whether torch's forward SAC mode asks the policy after the op ran (2.12+: it shows the policy the op's output)
_POLICY_AFTER_OP = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def _sac_contexts(policy_fn: Callable[..., CheckpointPolicy],
                 tracker: _ScopeTracker | None = None) -> tuple[_SACPass, _SACPass]:
    """`torch.utils.checkpoint` contexts for `policy_fn` in eager mode: torch's SAC modes (fresh storage per call),
    each with the FSDP runtime bypass, with a fresh recompute memo (`core.recompute`: a comm backend's dispatch that
    runs again in the recompute reuses its forward's layout), and with `tracker`'s per-pass scope state when given."""
    memo = RecomputeMemo()

    def deciding(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        # what an op offered the memo is kept only if the recompute runs the op again (not if SAC saves its outputs)
        decision = policy_fn(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            memo.decide(decision not in _SAVED, op_ran=_POLICY_AFTER_OP)
        return decision

    fwd_mode, recompute_mode = create_selective_checkpoint_contexts(deciding)
    return _SACPass(fwd_mode, memo, tracker, True), _SACPass(recompute_mode, memo, tracker, False)

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
        table = op_table()
        names = table.save_ops(self.save_names)
        # op -> the conditions under which it counts as saved (None: always); `_to_copy` is saved only as a host
        # copy, never as a dtype cast
        self.save: dict[torch._ops.OpOverload, list[Callable | None]] = collections.defaultdict(list)
        for name in names:
            for ref in table.ops[name]:
                op = ref.resolve()
                if op is not None:
                    self.save[op].append(ref.when)
        self.pinned = frozenset(op for name in names if name in table.collectives for op in table.resolve(name))
        self.host_copies = {ref.resolve(): ref.when for ref in table.ops["d2h_copy"]}
        self.rule_ops = [
            (targets, direct, None if kinds is None else frozenset(op for k in kinds for op in table.resolve(k)))
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

def user_force_modules(ac_cfg) -> list[str]:
    """The names in `force_recompute_modules` that the user wrote (not those "default" stands for), where the mode
    reads the key (selective per op, budget)."""
    if (ac_cfg.mode, ac_cfg.granularity) != ("selective", "op") and ac_cfg.mode != "budget":
        return []
    return [name for name in ac_cfg.force_recompute_modules if name != DEFAULT]


def block_module_names(model: nn.Module) -> list[str]:
    """The names of `model`'s modules relative to their block, as the module-name keys take them: a block is an
    entry of a module list or dict keyed by number (`layers.3`), and a module inside it is named from there on
    (`layers.3.moe.router` is "moe.router")."""
    names = set()
    for fqn, _ in model.named_modules():
        parts = fqn.split(".")
        numbered = [i for i, part in enumerate(parts) if part.isdigit()]
        if numbered and numbered[-1] < len(parts) - 1:
            names.add(".".join(parts[numbered[-1] + 1:]))
    return sorted(names)


def force_modules_warning(ac_cfg, model: nn.Module) -> str | None:
    """One warning line naming the `force_recompute_modules` the user set that match no module inside any block of
    the whole `model` (every pipeline stage's blocks; build it on the meta device), else None.

    Judged once for the whole model, not per model part: a pipeline stage may hold no block with a given module (only
    the dense first layer, say), which is no mistake. The names "default" stands for are the model's own and never
    judged: the user cannot act on them.
    """
    names = user_force_modules(ac_cfg)
    if not names:
        return None
    known = block_module_names(model)
    unmatched = [name for name in names if not any(denotes(fqn, name) for fqn in known)]
    if not unmatched:
        return None
    verb = "matches" if len(unmatched) == 1 else "match"
    return (f"activation_checkpoint.force_recompute_modules: {', '.join(map(repr, unmatched))} {verb} no module of "
            f"the model's blocks (names or dotted parts of: {', '.join(known)}); nothing is recomputed for "
            f"{'it' if len(unmatched) == 1 else 'them'}")


def _covering_modules(block: nn.Module, rules: Sequence[ScopeRule]) -> list[str]:
    """Block-relative FQNs to checkpoint for `rules`: every match, minus those inside another match."""
    matched = {f for f, _ in block.named_modules() if f and any(denotes(f, r.module) for r in rules)}
    return sorted(f for f in matched if not any(f.startswith(other + ".") for other in matched))


def _syncs_with_host(block: nn.Module) -> bool:
    """Whether an MoE of `block` routes through a communicating dispatcher (EP), which syncs split sizes."""
    return any(not m.dispatcher.traceable for m in block.modules()
               if isinstance(getattr(m, "dispatcher", None), TokenDispatcher))


def _routing_metadata_policy(table: OpTable, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Full AC of an EP block: recompute everything but the host copies and the integer all-to-alls.

    Those are the split sizes (a few ints per rank): saving them keeps EP at one host sync per MoE layer and
    step, where a plain full checkpoint would exchange and sync them again in backward. Token rows (floating
    point, or e4m3 as `FP8_WIRE_DTYPE` bytes) are recomputed, communication included, like any other activation of
    a fully checkpointed block.
    """
    kind = table.kind(op, args, kwargs)
    if kind == "d2h_copy" or (kind == "all_to_all" and not args[0].is_floating_point()
                              and args[0].dtype != FP8_WIRE_DTYPE):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep_routing_metadata():
    """context_fn of full AC for EP blocks (see `_routing_metadata_policy`); the op table is looked up once per
    checkpointed call, not for every op the policy sees."""
    return _sac_contexts(functools.partial(_routing_metadata_policy, op_table()))


def apply_ac(layers: nn.ModuleDict, ac_cfg, recompute_modules: RecomputeTable,
             default_force_recompute: Sequence[str] = ()) -> None:
    """Apply the `[activation_checkpoint]` section `ac_cfg` to the blocks in `layers` (keyed by global layer id)
    in place, with the model's recompute-name table `recompute_modules` and the modules its
    `force_recompute_modules` "default" stands for (`core.names.ModuleDefaults`). Mode budget applies each block's
    own entry of `per_layer` (chosen before launch, `trainer.tools.plan.resolve_ac_budget`).

    Call it after expert parallelism (the dispatcher must be in place) and before compile and FSDP. Blocks become
    `CheckpointWrapper`s: attribute access is forwarded and state_dict keys are unchanged, but
    `named_parameters()` shows a `_checkpoint_wrapped_module.` component.
    """
    # Names only: a caller may vary the mode over one section (benchmarks/ac_sweep.py) and leave the settings of
    # the other modes in it; validate_job rejects such a section in a job.
    problem = name_problem(ac_cfg, recompute_modules)
    if problem is not None:
        key, what, allowed = problem
        raise ValueError(f"{key}: {what}; allowed: {allowed}")
    if ac_cfg.mode == "none":
        return
    wrapper_kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT, "preserve_rng_state": True,
                                      "early_stop": ac_cfg.early_stop}
    if ac_cfg.mode == "full":
        for name, block in list(layers.items()):
            layers[name] = _full(block, wrapper_kwargs)
        return
    if ac_cfg.mode == "selective" and ac_cfg.granularity == "layer":
        for name, block in list(layers.items()):
            # layer ids are global (pipeline stages keep them), so the choice does not depend on the PP split
            if (int(name) + 1) % ac_cfg.layer_freq == 0:
                layers[name] = _full(block, wrapper_kwargs)
        return

    # names that match no module of these blocks are no mistake here (a pipeline stage of dense blocks has no
    # router); `force_modules_warning` judges the user's names against the whole model once
    force = resolve(ac_cfg.force_recompute_modules, default_force_recompute)
    rules = [ScopeRule(name) for name in force]
    if ac_cfg.mode == "budget":
        choices = parse_per_layer(ac_cfg.per_layer)
        missing = [name for name in layers if int(name) not in choices]
        if missing:
            raise ValueError(f"activation_checkpoint.per_layer has no entry for layer(s) {', '.join(missing)} (mode "
                             "budget is resolved before launch: trainer.tools.plan.resolve_ac_budget)")
        for name, block in list(layers.items()):
            choice = choices[int(name)]
            if choice.mode == "full":
                layers[name] = _full(block, wrapper_kwargs)
            elif choice.mode == "op":
                layers[name] = _selective(block, choice.save_ops, rules, wrapper_kwargs)
        return
    if not ac_cfg.recompute_modules:
        for name, block in list(layers.items()):
            layers[name] = _selective(block, ac_cfg.save_ops, rules, wrapper_kwargs)
        return

    rules += [rule for name in ac_cfg.recompute_modules for rule in recompute_modules[name]]
    for block in layers.values():
        for fqn in _covering_modules(block, rules):
            module = block.get_submodule(fqn)
            policy = _SelectivePolicy(ac_cfg.save_ops, _ScopeTracker(module, fqn, rules))
            composable_checkpoint(module, context_fn=policy.context_fn(), preserve_rng_state=True,
                                  early_stop=ac_cfg.early_stop)


def _full(block: nn.Module, wrapper_kwargs: dict[str, Any]) -> nn.Module:
    """`block` fully checkpointed (an EP block keeps its routing metadata, `_routing_metadata_policy`, and replays
    a comm backend's exchange layout from its recompute memo, `_sac_contexts`)."""
    extra = {"context_fn": _keep_routing_metadata} if _syncs_with_host(block) else {}
    return checkpoint_wrapper(block, **wrapper_kwargs, **extra)


def _selective(block: nn.Module, save_ops: Sequence[str], rules: Sequence[ScopeRule],
               wrapper_kwargs: dict[str, Any]) -> nn.Module:
    """`block` under per-op SAC: the outputs of `save_ops` saved, the ops inside `rules`' modules recomputed."""
    policy = _SelectivePolicy(save_ops, _ScopeTracker(block, "", rules))
    return checkpoint_wrapper(block, context_fn=policy.context_fn(), **wrapper_kwargs)

# ----------------------------------------------------------------------------------------------- measurement

class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active: by overload (`counts["aten.mm.default"]`) and by op-table name
    (`kinds["mm"]`, "other" for the rest).

    What a backward recomputes is the difference between the counts of the same backward with and without AC.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()
        self._table = op_table()  # the backends registered when counting starts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counts[str(func)] += 1
        self.kinds[self._table.kind(func, args, kwargs) or "other"] += 1
        return func(*args, **kwargs)
