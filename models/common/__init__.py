"""Building blocks shared by model families: the layout-invariant parameter initialisation (`init`).

The contracts a model shares with the parallelisms and the trainer (token dispatch, the quantized-GEMM hook, the
recompute test) are in `core/`; this package imports nothing from the parallelisms or the trainer.
"""
