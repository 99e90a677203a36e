"""Whether the forward running now is an activation-checkpoint recompute, for work done once per forward.

A module that updates statistics in its forward (the MoE's token counts) must not update them again when
activation checkpointing recomputes that forward in backward. The test lives here, not in the parallelisms: it
must hold whoever checkpoints the module (the trainer's `apply_ac`, or a user's `torch.utils.checkpoint`), so it
asks the autograd engine, not the checkpointing code.
"""

from __future__ import annotations

import torch


def in_recompute() -> bool:
    """Whether this forward is a recompute, which runs inside backward.

    Eager: a recompute runs inside the autograd engine (graph task id != -1). Compiled: the code being traced is
    the forward; a checkpointed region inside it is recomputed by the compiled backward graph, which does not
    re-run the forward's Python (tests/test_compile.py checks the MoE's counts). The engine query is not
    traceable, hence the split. A compiled graph must therefore never run inside an eager checkpoint's recompute
    with such work in it: `parallelisms/compile.py` keeps `MoE.forward` eager whenever the block is not one graph.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1
