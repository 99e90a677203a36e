"""Preemption: a scheduler's signal (SLURM `--signal`, `scancel`, Kubernetes' SIGTERM) ends a run with a checkpoint
of its last finished step, inside the grace period.

Each rank installs a handler for `checkpoint.preemption_signals` (default TERM and USR1) that only records the
signal. The loop asks `Preemption.requested()` at every step boundary, between the microbatches of a step and
between validation batches: one all-reduce (MAX) of a one-element flag over a gloo group of its own, so every rank
sees the same answer at the same point, whichever rank or ranks got the signal, and the rank that did not catch it
stops too. The trainer then saves a synchronous checkpoint of the last finished step (an interrupted step is
rolled back: its gradients are dropped, the data loader rewound), logs the time from the signal to the saved
checkpoint, and the process exits 0: torchrun sees a finished worker and does not restart it. `trainer.launch`
then ends with `EXIT_PREEMPTED` (docs/errors.md).

A second SIGTERM while the first is being honoured exits at once (exit code 143). A signal that arrives during
the first compile or a long checkpoint save is seen at the next poll after it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["EXIT_PREEMPTED", "STOP_FILE_ENV", "Preemption", "PreemptedError", "parse_signals"]

logger = logging.getLogger("trainer")

EXIT_PREEMPTED = 75
"""Exit code of `trainer.launch` after a preemption checkpoint (EX_TEMPFAIL: requeue and run the same command)."""
STOP_FILE_ENV = "TRAINER_PREEMPTION_FILE"
"""Environment variable `trainer.launch` sets: where rank 0 writes what a preemption saved, for its last line."""


class PreemptedError(Exception):
    """Raised inside the loop when the ranks agreed to stop: unwinds an interrupted step or validation."""


def parse_signals(names: list[str]) -> list[signal.Signals]:
    """`["TERM", "USR1"]` -> the signals; ValueError naming an unknown one."""
    found = []
    for name in names:
        upper = name.strip().upper()
        try:
            found.append(signal.Signals[upper if upper.startswith("SIG") else f"SIG{upper}"])
        except KeyError:
            raise ValueError(f"unknown signal {name!r}") from None
    return found


class Preemption:
    """The preemption handlers of one rank and the agreement across ranks (see the module docstring).

    signals: what to handle (empty: nothing is installed and `requested` is always False).
    group: the process group to agree over (a gloo group of its own, so that the flag is a CPU tensor and the poll
        never waits for a device), or None in a single process.
    """

    def __init__(self, signals: list[signal.Signals], group: dist.ProcessGroup | None):
        self.signals = signals
        self.group = group
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._previous = {}
        if signals and threading.current_thread() is not threading.main_thread():
            # Python delivers signals to the main thread only: a trainer built elsewhere cannot be preempted
            logger.warning("checkpoint.preemption_signals: the trainer does not run in the main thread; preemption "
                           "signals keep their default action")
            self.signals = []
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGTERM:
            os._exit(128 + signal.SIGTERM)  # a second SIGTERM: the scheduler will not wait any longer
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()

    def requested(self) -> bool:
        """Whether any rank received a preemption signal; collective: every rank calls it at the same points."""
        if not self.signals:
            return False
        self._flag.fill_(1 if self.received is not None else 0)
        if self.group is not None:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        if self._flag.item() and self.received_at is None:
            self.received_at = time.monotonic()  # another rank got it; the time is counted from this poll
        return bool(self._flag.item())

    def seconds_since_signal(self) -> float:
        return time.monotonic() - self.received_at if self.received_at is not None else 0.0

    def close(self) -> None:
        """Restore the handlers that were installed before (a test runs several jobs in one process)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
