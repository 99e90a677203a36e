"""Hung ranks: a heartbeat per rank in the store every rank already joins, watched by rank 0.

Every rank runs a daemon thread that writes `<step> <time>` under `heartbeat/<rank>` once a second (the step it is
in). A rank that is stopped (SIGSTOP, a frozen node) or stuck holding the interpreter stops writing; a rank that
only waits in a collective for such a peer keeps writing (collectives release the interpreter). Rank 0's watchdog
thread reads every heartbeat once a second; when one is older than the timeout of the phase (the init timeout until
the first steps are done, the train timeout after), it prints one line naming the silent rank(s) and their step,
leaves it for `trainer.launch`, and ends its process with exit code 1. torchrun then stops the other ranks (SIGTERM,
then SIGKILL 30 s later for a rank that does not stop, as a stopped one): no process of the job is left, and the
last published checkpoint is untouched (a save in flight never publishes).

The process-group timeout (`[comm]`, plus `COLLECTIVE_MARGIN_S` after the first steps) is the backstop for a hang
the heartbeat cannot see (a collective that never completes while every rank is alive): the collective then raises
on every rank.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from trainer.config import option

__all__ = ["COLLECTIVE_MARGIN_S", "CommSection", "Heartbeat", "set_process_group_timeouts"]

logger = logging.getLogger("trainer")

COLLECTIVE_MARGIN_S = 15
"""Collectives time out this much later than a silent heartbeat counts as a hang, so that the watchdog's line, which
names the rank, comes first; a collective's own timeout names nobody."""


@dataclass
class CommSection:
    """Communication timeouts (the names torchtitan uses)."""

    init_timeout_seconds: int = option(300, ge=1)
    """Timeout of process-group creation and of every collective until the first `init_timeout_steps` steps are
    done (the first compile and warm-up run there)."""
    train_timeout_seconds: int = option(100, ge=1)
    """How long rank 0 waits for a silent rank's heartbeat after the first steps before ending the job with a line
    naming it; collectives time out 15 s later."""
    init_timeout_steps: int = option(1, ge=0)
    """Steps that run under the init timeout."""


def set_process_group_timeouts(seconds: float) -> None:
    """Set the timeout of every process group of this process (the default group and the mesh groups)."""
    timeout = timedelta(seconds=seconds)
    c10d = dist.distributed_c10d
    groups = [dist.group.WORLD] + [g for g in list(c10d._world.pg_names) if g is not dist.group.WORLD]
    for group in groups:
        c10d._set_pg_timeout(timeout, group)


class Heartbeat:
    """This rank's heartbeat thread and, on rank 0, the watchdog (see the module docstring).

    `step` is the step the rank is in, set by the loop; `timeout` the silence after which a rank counts as hung
    and `timeout_key` the setting it comes from (the loop moves both from the init to the train timeout).
    """

    PERIOD = 1.0

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float, on_hung=None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timeout
        self.timeout_key = "comm.init_timeout_seconds"
        self.step = 0
        self.on_hung = on_hung or _end_job
        self._stop = threading.Event()
        self._beat()
        self._threads = [threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True)]
        if rank == 0:
            self._threads.append(threading.Thread(target=self._watch_loop, name="watchdog", daemon=True))
        for thread in self._threads:
            thread.start()

    def _beat(self) -> None:
        self.store.set(f"heartbeat/{self.rank}", f"{self.step} {time.time():.3f}")

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.PERIOD):
            try:
                self._beat()
            except Exception:  # the store is gone: the job is ending
                return

    def silent_ranks(self, now: float | None = None) -> list[tuple[int, int, float]]:
        """(rank, step, seconds since its last heartbeat) of every rank silent longer than the timeout."""
        now = time.time() if now is None else now
        keys = [f"heartbeat/{r}" for r in range(self.world_size)]
        values = self.store.multi_get(keys)
        silent = []
        for rank, raw in enumerate(values):
            step, stamp = raw.decode().split()
            if now - float(stamp) > self.timeout:
                silent.append((rank, int(step), now - float(stamp)))
        return silent

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.PERIOD):
            try:
                silent = self.silent_ranks()
            except Exception:
                return
            if silent:
                self.on_hung(_hung_line(silent, self.step, self.timeout, self.timeout_key))
                return

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.PERIOD)


def _hung_line(silent: list[tuple[int, int, float]], step: int, timeout: float, key: str) -> str:
    ranks = ", ".join(f"rank {rank} (in step {at}, silent {gap:.0f} s)" for rank, at, gap in silent)
    return (f"training error: {ranks} stopped making progress while rank 0 is in step {step}: no heartbeat for "
            f"more than {key} = {timeout:g} s (stopped, frozen or stuck); ending the job")


def _end_job(line: str) -> None:
    """Rank 0 gives up on a silent rank: its line, left for the launcher, then exit 1 (torchrun stops the rest)."""
    from trainer.launch import write_error_line

    logging.shutdown()
    print(line, flush=True, file=sys.stderr)
    write_error_line(line)
    os._exit(1)
