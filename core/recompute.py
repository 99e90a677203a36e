"""Activation-checkpoint recompute as the code inside a checkpointed forward sees it.

Two contracts:
  * `in_recompute()`: whether the forward running now is a recompute, for work done once per forward. A module that
    updates statistics in its forward (the MoE's token counts) must not update them again in backward. It asks the
    autograd engine, not the checkpointing code, so it holds whoever checkpoints the module (the trainer's
    `apply_ac`, or a user's `torch.utils.checkpoint`).
  * `RecomputeMemo` with `record` / `replay`: what a checkpointed forward worked out on the host (a token exchange's
    layout), handed to its own recompute, so that the recompute neither waits for the device nor communicates to
    work it out again. The checkpointing code (`parallelisms/activation_checkpoint/policy.py`) owns one memo per
    checkpointed call and makes it current in each pass; without it (a user's plain `torch.utils.checkpoint`),
    `replay` returns None and the caller computes as in a forward.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["RecomputeMemo", "in_recompute", "record", "replay"]


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


class RecomputeMemo:
    """Values one checkpointed call's forward recorded for its recompute, replayed in the forward's order.

    Only the ops that the recompute will run again keep what they offer: the checkpointing code passes on its
    policy's decision for each op (`decide`), so an op whose outputs selective checkpointing saves keeps nothing,
    and the ops that do run again find their own values in order. An op that records must therefore pass through
    the checkpointing policy (not around the SAC mode). Each recompute pass reads from the first entry again: a
    call recomputed twice (a second backward with retain_graph, a pipeline schedule that recomputes for its input and
    its weight gradients) replays the same values both times. The memo belongs to the call's checkpoint contexts,
    which the autograd graph holds until its backward ran or it is dropped: nothing recorded outlives the graph.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[Any, Any]] = []
        self._cursor = 0  # the next entry a replaying pass hands out
        self._offered: tuple[Any, Any] | None = None  # what the op that just ran offered, until the policy decides
        self._asks_before = False  # the policy is asked before each op runs (torch < 2.12), not after
        self._recompute_next = False  # then: its decision for the op about to run, until that op offers

    def __len__(self) -> int:
        return len(self._entries)

    def decide(self, recomputed: bool, op_ran: bool) -> None:
        """The policy's decision for one op of the forward: whether the recompute runs it again. torch's SAC asks
        the policy after the op ran (`op_ran`, torch >= 2.12: it shows the policy the output) or before."""
        if op_ran:
            offered, self._offered = self._offered, None
            if offered is not None and recomputed:
                self._entries.append(offered)
        else:
            self._asks_before, self._recompute_next = True, recomputed

    def _offer(self, key: Any, value: Any) -> None:
        if not self._asks_before:
            self._offered = (key, value)  # the policy decides after this op
            return
        if self._recompute_next:
            self._entries.append((key, value))
        self._recompute_next = False  # a second offer before the next decision comes from an op the policy missed

    def _next(self, key: Any) -> Any | None:
        if self._cursor >= len(self._entries):
            return None
        recorded_key, value = self._entries[self._cursor]
        if recorded_key != key:
            self._entries.clear()  # this recompute does not follow its forward: trust nothing recorded
            return None
        self._cursor += 1
        return value

    def activate(self, recording: bool) -> tuple | None:
        """Make this memo current on this thread for one pass (the forward records, a recompute replays from the
        first entry); returns what was current, for `deactivate`."""
        previous = getattr(_current, "pass_", None)
        self._cursor = 0
        _current.pass_ = (self, recording)
        return previous

    @staticmethod
    def deactivate(previous: tuple | None) -> None:
        """Restore what `activate` returned (passes nest: a checkpointed module inside another's pass)."""
        _current.pass_ = previous


_current = threading.local()


def record(key: Any, value: Any) -> None:
    """In the forward pass of a checkpointed call, keep `value` for the recompute of the op running now, if the
    recompute will run that op again; a no-op anywhere else. `key` names what the value is for (the op and its
    input shapes): `replay` hands the value only to a call with the same key."""
    pass_ = getattr(_current, "pass_", None)
    if pass_ is not None and pass_[1]:
        pass_[0]._offer(key, value)


def replay(key: Any) -> Any | None:
    """In a recompute, the value the forward recorded for this op (the next one recorded, if its key is `key`);
    None anywhere else, or when the forward recorded none. A different key means this recompute does not follow
    its forward: nothing recorded is trusted then (the memo is emptied) and the caller computes anew."""
    pass_ = getattr(_current, "pass_", None)
    if pass_ is None or pass_[1]:
        return None
    return pass_[0]._next(key)
