"""Activation checkpointing (AC) of the transformer blocks: what forward keeps, what backward recomputes.

`apply_ac(layers, ac_cfg, recompute_modules, default_force_recompute)` (`policy.py`) applies the `[activation_checkpoint]` section to the blocks in
`layers` (a ModuleDict keyed by the global layer id), which the model's parallelize plan hands in together with its
recompute-name table (models/deepseek_v3/parallelize.py for DeepSeek-V3):

    none                          nothing changes
    full                          every block keeps only its input and recomputes everything in backward (an EP
                                  block also keeps its exchange's layout: no second host sync, see below)
    selective, granularity=layer  every `layer_freq`-th block (by global layer id) is checkpointed fully, as full
    selective, granularity=op     per-op selective checkpointing (SAC) of every block, as data:
        save_ops                  op-table names (`ops.py`) whose outputs are saved; every other op is recomputed
        force_recompute_modules   submodules (dotted FQN suffixes inside a block) whose ops are recomputed even
                                  when their op is in save_ops
    budget, per_layer             each block its own choice, one entry per layer: none, full, or per-op SAC saving
                                  the ops it names (`budget.py`); chosen before launch for memory_budget_gib
                                  by the memory plan (`trainer.tools.plan.resolve_ac_budget`)
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
An op that the recompute runs again may also take what its forward worked out on the host instead of working it
out again: a comm backend's dispatch records its exchange's layout in the call's recompute memo
(`core.recompute`), and its recompute sends the rows with that layout (no layout exchange, no wait on the host).
The SAC passes keep one memo per checkpointed call and tell it which ops the policy recomputes.

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
Work that runs in forward only (statistics guarded by `core.recompute.in_recompute`) must therefore not use
an op that a policy saves (`_to_copy` included: d2h copies are saved). Process-wide state (comm buffers) must be
created before the first forward, outside any checkpointed region: ops run while creating it would enter the SAC
cache.

The package, one concern per module:

    config.py   the [activation_checkpoint] section and its checks before a model exists
    ops.py      the op table: the short names save_ops takes, the ops they stand for, the registered backends' ops
    budget.py   mode budget: the per_layer entries, and the solver that chooses them under a planned peak
    policy.py   the scope tracker, the SAC passes, the per-op policy, apply_ac, and OpCounter (ops by table name)
"""
