"""Building blocks shared by model families and seen by the parallelisms: the token-dispatch interface of an MoE
layer (`token_dispatch`), the layout-invariant parameter initialisation (`init`), the hook through which a
precision conversion replaces the routed experts' grouped GEMM (`grouped_mm`) and the test that keeps
forward-only work out of activation-checkpoint recomputes (`recompute`).

The parallelisms and the trainer may import this package; it imports nothing from either, so a model module can
use it without an import cycle.
"""
