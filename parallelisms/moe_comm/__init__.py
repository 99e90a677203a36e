"""MoE token dispatch: the dispatcher interface (`base`), the backend registry (`registry`) and the built-in
backends, which register themselves on import: `alltoall` (all_to_all_single) and `deepep` (DeepEP's kernels, or
their CPU stand-in on gloo)."""

from parallelisms.moe_comm import alltoall, deepep  # noqa: F401  (imported for their registration)
