"""MoE token dispatch: the backend registry (`registry`) and the built-in backends, which register themselves on
import: `alltoall` (all_to_all_single) and `deepep` (DeepEP's kernels, or their CPU stand-in on gloo). The
dispatcher interface they implement is `core.token_dispatch`."""

from parallelisms.moe_comm import alltoall, deepep  # noqa: F401  (imported for their registration)
