"""Hung ranks: a heartbeat per rank that carries its progress, in the store every rank already joins, watched by
two ranks per node.

Progress. The loop calls `Heartbeat.advance` at points of a step (its start, after its batch is read, before each
microbatch's forward and backward, before the optimizer, at the step's end, before each validation batch, before
a checkpoint save): the rank's position is the number of points it passed, with the step and the point's name for
the line. Every rank passes the same points in the same order, so positions compare across ranks.

Compiling. torch.compile compiles a graph when it first runs (the forward in dynamo, the backward lazily in the
first backward), inside a step: a cold compile of many graphs on a busy machine can take longer than the timeout
while every rank stays at one point. Each compile's start and end (torch's `torch._dynamo.callback` hooks, which
both kinds run) therefore count as progress, without moving the position (ranks compile different numbers of
graphs: pipeline stages, recompiles), and while a rank compiles its point says so. Only one graph's compile longer
than the timeout ends the job, with a line that says the ranks are compiling and names the key to raise.

Liveness. Every rank runs a daemon thread that writes `<beat> <position> <step> <watches> <patience> <compiles>
<compiling> <point>` under `heartbeat/<rank>` once a second; `beat` counts the writes, `patience` is how long its
point may take (a checkpoint save's `comm.checkpoint_timeout_seconds`; 0: the phase's timeout), `compiles` counts
the compiles' starts and ends and `compiling` is 1 inside one. A rank that is stopped (SIGSTOP, a frozen node) or
holds the interpreter stops beating. A rank blocked in a call that releases the interpreter (a hung file system
read, a device sync, a collective) keeps beating but no longer advances.

Watching. The ranks with local rank 0 and 1 read every heartbeat once a second and note, on their own clock, when
each rank last beat and last advanced. Two per node, not every rank: a stopped rank 0 is seen by rank 1 and a
frozen node by the other nodes, while the store serves 2 x nodes x world reads a second instead of world squared.
When a rank has not beaten for longer than the timeout of the phase (the init timeout until the first steps are
done, the train timeout after), it is named as silent; a rank that never wrote a heartbeat counts as silent since
the watcher started. When no rank advanced for longer than the timeout, the ranks at the lowest position are named
as behind; when every rank is at the same position, the line says that no rank advanced and where they all are.

Ending. The lowest watching rank that is not named reports (another watcher takes over when that one has not done
so three periods later): one line in its torchrun error file (on its stderr too without `trainer.launch`, which
prints it once for the job), the line under `hung` in the store (the watchers of other nodes leave it for their own
launcher), and the `hung` marker for `trainer.launch`, which kills every process of the job on its node at once
with SIGKILL (nothing is to be saved, and a stopped rank would hold torchrun's teardown for 30 s); then exit code
1. The last published checkpoint is untouched (a save in flight never publishes).

The process-group timeout (`[comm]`, plus `COLLECTIVE_MARGIN_S` after the first steps) is the backstop when every
watcher is hung too: a collective then raises on the ranks still running.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch._dynamo.callback import callback_handler
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from core.config import option
from trainer.compile_times import remove_compile_callbacks
from trainer.launch import HUNG_MARKER, leave_marker, report_line

__all__ = ["COLLECTIVE_MARGIN_S", "CommSection", "Heartbeat", "set_process_group_timeouts"]

logger = logging.getLogger("trainer")

COLLECTIVE_MARGIN_S = 15
"""Collectives time out this much later than a rank counts as hung, so that the watchdog's line, which names the
rank, comes first; a collective's own timeout names nobody."""

_HUNG_KEY = "heartbeat/hung"  # the reporting watcher's line, for the watchers of the other nodes
_DONE = "done"  # the point name of a rank that closed its heartbeat: it is no longer watched


@dataclass
class CommSection:
    """Communication timeouts (the names torchtitan uses)."""

    init_timeout_seconds: int = option(300, ge=1)
    """Timeout of process-group creation and of every collective until the first `init_timeout_steps` steps are
    done (the first compile and warm-up run there); also how long a rank may be silent or no rank advance then."""
    train_timeout_seconds: int = option(100, ge=1)
    """After the first steps: how long a rank may be silent (no heartbeat) or no rank advance (a step's part, a
    validation batch) before the job ends with a line naming the rank(s); collectives time out 15 s later."""
    checkpoint_timeout_seconds: int = option(1800, ge=1)
    """How long a checkpoint save may take before the ranks still in it count as hung (a large model written to a
    shared file system takes minutes); collectives time out 15 s later while a save runs."""
    init_timeout_steps: int = option(1, ge=0)
    """Steps that run under the init timeout."""


def set_process_group_timeouts(seconds: float) -> None:
    """Set the timeout of every process group of this process (the default group and the mesh groups)."""
    timeout = timedelta(seconds=seconds)
    for group in [dist.group.WORLD, *_other_groups()]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _other_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process but the default one (the mesh groups, the preemption flag's)."""
    return [g for g in list(dist.distributed_c10d._world.pg_names) if g is not dist.group.WORLD]


def reset_process_group_timeouts(world_seconds: float) -> None:
    """Give every process group the timeout it was created with: the default group `world_seconds` (its init
    timeout), every other group torch's default for a new group of its backend (what the mesh groups start with)."""
    c10d = dist.distributed_c10d
    c10d._set_pg_timeout(timedelta(seconds=world_seconds), dist.group.WORLD)
    for group in _other_groups():
        nccl = "nccl" in dist.get_backend(group) and default_pg_nccl_timeout is not None
        c10d._set_pg_timeout(default_pg_nccl_timeout if nccl else default_pg_timeout, group)


@dataclass
class _Seen:
    """What a watcher knows of one rank: its last heartbeat and, on the watcher's clock, when it last beat and last
    advanced."""

    beat: int = -1
    position: int = -1
    step: int = 0
    point: str = "before its first heartbeat"
    patience: float = 0.0  # how long this rank's point may take without advancing (0: the phase's timeout)
    compiles: int = -1  # starts and ends of torch.compile's compiles: progress that does not move the position
    compiling: bool = False
    watches: bool = False
    beat_at: float = 0.0
    advanced_at: float = 0.0
    done: bool = False


class Heartbeat:
    """This rank's heartbeat thread and, on two ranks per node, the watchdog (see the module docstring).

    `timeout` is how long a rank may be silent or no rank advance, `timeout_key` the setting it comes from (the
    loop moves both from the init to the train timeout). `on_hung(line)` ends the job (default: `_end_job`).
    """

    PERIOD = 1.0

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float, local_rank: int | None = None,
                 on_hung=None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timeout
        self.timeout_key = "comm.init_timeout_seconds"
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        self.watches = local_rank < 2
        self.on_hung = on_hung or self._end_job
        self._at = (0, 0, "starting", 0.0)  # (position, step, point, patience): one tuple, read whole
        self._compile = (0, False)  # (compiles started and ended, compiling now): one tuple, read whole
        self._beats = 0
        self._stop = threading.Event()
        self._beat()  # first: a store that fails here leaves nothing registered behind
        callback_handler.register_start_callback(self._compile_started)
        callback_handler.register_end_callback(self._compile_ended)
        self._threads = [threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True)]
        if self.watches:
            self._threads.append(threading.Thread(target=self._watch_loop, name="watchdog", daemon=True))
        for thread in self._threads:
            thread.start()

    @property
    def step(self) -> int:
        """The step this rank is in."""
        return self._at[1]

    def advance(self, point: str, step: int | None = None, patience: float = 0.0) -> None:
        """This rank reached `point` of the loop (in `step`, or the current step): its position moves on by one.
        `patience`: how long the point may take without counting as a hang, when longer than the phase's timeout
        (a checkpoint save)."""
        position, current, _, _ = self._at
        self._at = (position + 1, current if step is None else step, point, patience)

    # torch 2.13 passes a `CallbackArgs` (what triggered the compile); older releases passed nothing
    def _compile_started(self, *args) -> None:
        self._compile = (self._compile[0] + 1, True)

    def _compile_ended(self, *args) -> None:
        self._compile = (self._compile[0] + 1, False)

    def _beat(self, point: str | None = None) -> None:
        position, step, at, patience = self._at
        compiles, compiling = self._compile
        self._beats += 1
        self.store.set(f"heartbeat/{self.rank}", f"{self._beats} {position} {step} {int(self.watches)} {patience:g} "
                                                 f"{compiles} {int(compiling)} {point or at}")

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.PERIOD):
            try:
                self._beat()
            except Exception:  # the store is gone: the job is ending
                return

    def _read(self) -> list[str | None]:
        """Every rank's heartbeat, None for a rank that has not written one (`multi_get` would wait for it)."""
        keys = [f"heartbeat/{r}" for r in range(self.world_size)]
        if self.store.check(keys):
            return [raw.decode() for raw in self.store.multi_get(keys)]
        return [self.store.get(key).decode() if self.store.check([key]) else None for key in keys]

    def observe(self, seen: list[_Seen], values: list[str | None], now: float) -> None:
        """Update what the watcher knows from the heartbeats read at `now` (its monotonic clock)."""
        for state, raw in zip(seen, values):
            if raw is None:
                continue
            beat, position, step, watches, patience, compiles, compiling, point = raw.split(" ", 7)
            if int(beat) != state.beat:
                state.beat, state.beat_at = int(beat), now
            if int(position) != state.position or int(compiles) != state.compiles:
                state.position, state.compiles, state.advanced_at = int(position), int(compiles), now
            state.step, state.watches, state.point, state.patience = int(step), watches == "1", point, float(patience)
            state.compiling = compiling == "1"
            state.done = point == _DONE

    def verdict(self, seen: list[_Seen], now: float) -> tuple[list[int], str] | None:
        """(the ranks named, the line) when the job hangs, else None."""
        watched = [r for r, s in enumerate(seen) if not s.done]
        silent = [r for r in watched if now - seen[r].beat_at > self.timeout]
        if silent:
            ranks = ", ".join(f"rank {r} ({self._where(seen[r])}, silent {now - seen[r].beat_at:.0f} s)"
                              for r in silent[:8])
            more = f" and {len(silent) - 8} more" if len(silent) > 8 else ""
            return silent, (f"training error: {ranks}{more} stopped making progress while rank {self.rank} is in "
                            f"step {self.step}: no heartbeat for more than {self.timeout_key} = {self.timeout:g} s "
                            "(stopped, frozen or holding the interpreter); ending the job")
        if not watched:
            return None
        lowest = min(seen[r].position for r in watched)
        behind = [r for r in watched if seen[r].position == lowest]
        # the ranks behind may be at a point allowed to take longer (a checkpoint save)
        limit = max(self.timeout, min(seen[r].patience for r in behind))
        if now - max(seen[r].advanced_at for r in watched) <= limit:
            return None
        where = self._where(seen[behind[0]])
        key = self.timeout_key if limit == self.timeout else "comm.checkpoint_timeout_seconds"
        rule = f"no rank advanced for more than {key} = {limit:g} s"
        # a compile is progress when it ends: still in one after the timeout, it is a single slow graph
        compiling = any(seen[r].compiling for r in behind)
        why = (f": one graph's compile took longer than that (a cold compile cache, a busy machine); raise {key}"
               if compiling else None)
        if len(behind) == len(watched):
            why = why or " (a collective, the file system or a device hangs?)"
            return [], f"training error: {rule}: all {len(watched)} ranks are {where}{why}; ending the job"
        named = _rank_list(behind)
        ahead = max((r for r in watched if r not in behind), key=lambda r: seen[r].position)
        why = why or " (alive but stuck in a call that does not return: a hung file system, device or peer)"
        return behind, (f"training error: {named} stopped making progress {where} while rank {ahead} is "
                        f"{self._where(seen[ahead])}: {rule}{why}; ending the job")

    @staticmethod
    def _where(state: _Seen) -> str:
        if state.beat < 0:
            return "before its first heartbeat"
        return f"in step {state.step} ({state.point}{', compiling with torch.compile' if state.compiling else ''})"

    def _watch_loop(self) -> None:
        start = time.monotonic()
        seen = [_Seen(beat_at=start, advanced_at=start) for _ in range(self.world_size)]
        hung_since = None
        while not self._stop.wait(self.PERIOD):
            try:
                values = self._read()
                reported = self.store.get(_HUNG_KEY).decode() if self.store.check([_HUNG_KEY]) else None
            except Exception:  # the store is gone: the job is ending
                return
            if reported is not None:  # a watcher elsewhere reported: this node's launcher ends its ranks too
                reporter, line = reported.split(" ", 1)
                leave_marker(HUNG_MARKER, json.dumps({"rank": int(reporter), "line": line}))
                return
            now = time.monotonic()
            self.observe(seen, values, now)
            found = self.verdict(seen, now)
            if found is None:
                hung_since = None
                continue
            named, line = found
            hung_since = now if hung_since is None else hung_since
            candidates = [r for r, s in enumerate(seen) if s.watches and r not in named]
            if self.rank == min(candidates, default=self.rank) or now - hung_since > 3 * self.PERIOD:
                self.on_hung(line)
                return

    def _end_job(self, line: str) -> None:
        """Report a hang: the line for the launcher (on stderr without one), in the store for the other nodes' watchers;
        exit 1."""
        logging.shutdown()
        report_line(line)
        try:
            self.store.set(_HUNG_KEY, f"{self.rank} {line}")
        except Exception:
            pass  # the store is gone: this node's launcher still ends its ranks
        leave_marker(HUNG_MARKER, json.dumps({"rank": self.rank, "line": line}))
        os._exit(1)

    def close(self) -> None:
        """Stop beating and watching; the last heartbeat says this rank is done, so no watcher waits for it."""
        self._stop.set()
        remove_compile_callbacks(self._compile_started, self._compile_ended)
        for thread in self._threads:
            thread.join(timeout=2 * self.PERIOD)
        try:
            self._beat(_DONE)
        except Exception:
            pass  # the store is gone: the job is ending


def _rank_list(ranks: list[int]) -> str:
    """`rank 1`, `ranks 1, 3` or `ranks 1, 3, 5, 7, 9, 11, 13, 15 and 4 more`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(r) for r in ranks[:8])
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
