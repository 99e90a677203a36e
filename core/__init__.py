"""The contracts every layer shares: the config machinery, the model spec and its typed hook groups, the loss, the
memory-plan types, the token-dispatch interface, the quantized-GEMM hook and the module-name rule.

Everything else builds on this package and it imports nothing of ours (standard library and torch only), so any
layer may use it without an import cycle or a climb back up the layers (tests/test_layering.py).
"""
