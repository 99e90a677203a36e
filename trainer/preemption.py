"""Preemption: a scheduler's signal (SLURM `--signal`, `scancel`, Kubernetes' SIGTERM) ends a run with a checkpoint
of its last finished step, inside the grace period.

Recording. A rank records `checkpoint.preemption_signals` (default TERM and USR1) from its first moment:
`python -m trainer.train` calls `listen` with the default signals before its own imports (which take seconds), and
again with the configured ones once the config is read (a signal recorded meanwhile that is no longer listed then
takes its action late). The handler only records; nothing else runs inside it.

Agreement. The loop asks `Preemption.requested()` before the first step (a signal during start-up, config or
checkpoint load), at every step boundary, between the microbatches of a step and between validation batches: one
all-reduce (MAX) of a one-element flag over a gloo group of its own, so every rank sees the same answer at the same
point, whichever rank or ranks got the signal, and the rank that did not catch it stops too. With pipeline
parallelism the schedule runs all microbatches of a step in one call, so there the polls are at step boundaries and
between validation batches only. The trainer then saves a synchronous checkpoint of the last finished step (an
interrupted step is rolled back: its gradients are dropped, the data loader rewound), or nothing when no step
finished yet, and leaves its line, with the times from the signal to the saved checkpoint and to the exit, for
`trainer.launch` (every rank, so that the launcher of every node sees it; rank 0 logs it when no launcher prints
it), and the process exits 0: torchrun sees a finished worker and does not restart it. `trainer.launch` then prints
the line once and ends with `EXIT_PREEMPTED`, 75 (docs/errors.md).

A second SIGTERM exits at once (exit code 143); one that comes within `SECOND_SIGTERM_AFTER_S` (1 s) of the first
preemption signal is the same request reaching the rank twice (SLURM signals every process of a job step, and the
launcher passes its own copy on). Python runs a signal handler only in the main thread, between bytecodes, so a
main thread blocked in a C call (a collective waiting for a peer, a device sync) would not run it before that call
returns. Each signal is therefore also written, by the C-level handler, into a pipe (`signal.set_wakeup_fd`) read
by a thread of its own; that thread tells the second SIGTERM and ends the process, whatever the main thread is
doing (blocked C calls release the interpreter). A rank whose main thread holds the interpreter cannot run even
that thread: `trainer.launch` kills the ranks with SIGKILL when it gets a second SIGTERM itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

from trainer.launch import EXIT_SECOND_SIGTERM, SECOND_SIGTERM_AFTER_S, report_line

__all__ = ["DEFAULT_SIGNALS", "Preemption", "PreemptedError", "Stop", "listen", "parse_signals", "stop_listening"]

logger = logging.getLogger("trainer")

DEFAULT_SIGNALS = ("TERM", "USR1")
"""The default of `checkpoint.preemption_signals`: what a rank records before its config is read, and what
`trainer.launch` passes on to the ranks."""


class PreemptedError(Exception):
    """Raised inside the loop when the ranks agreed to stop: unwinds an interrupted step or validation."""


def parse_signals(names: list[str] | tuple[str, ...]) -> list[signal.Signals]:
    """`["TERM", "USR1"]` -> the signals; ValueError naming an unknown one."""
    found = []
    for name in names:
        upper = name.strip().upper()
        try:
            found.append(signal.Signals[upper if upper.startswith("SIG") else f"SIG{upper}"])
        except KeyError:
            raise ValueError(f"unknown signal {name!r}") from None
    return found


class _Recorder:
    """This process's record of preemption signals: one per process, since signal handlers are process-wide.

    `received` is the first signal and `received_at` its time (monotonic). The main thread's handler records it;
    the reader of the wakeup pipe records it too (whichever runs first) and alone counts SIGTERMs, so that one
    signal is never counted twice.
    """

    def __init__(self) -> None:
        self.signals: list[signal.Signals] = []
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self._saved: dict[signal.Signals, object] = {}  # each signal's handler before the first `listen`
        self._saved_wakeup: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._reader: threading.Thread | None = None
        self._first_seen_at: float | None = None  # when the reader saw the first preemption signal

    def listen(self, signals: list[signal.Signals]) -> None:
        if signals and threading.current_thread() is not threading.main_thread():
            # Python delivers signals to the main thread only: a trainer built elsewhere cannot be preempted
            logger.warning("checkpoint.preemption_signals: the trainer does not run in the main thread; preemption "
                           "signals keep their default action")
            signals = []
        if signals and self._reader is None:
            self._start_reader()
        for sig in [s for s in self._saved if s not in signals]:
            signal.signal(sig, self._saved.pop(sig))
        for sig in signals:
            if sig not in self._saved:
                self._saved[sig] = signal.signal(sig, self._handle)
        self.signals = list(signals)
        late = self.received
        if late is not None and late not in self.signals:
            # recorded before the config said it is no preemption signal: it gets its own action now
            self.received = self.received_at = None
            signal.raise_signal(late)
        if not self.signals:
            self._stop_reader()

    def stop(self) -> None:
        """Restore the handlers from before the first `listen` and forget what was recorded."""
        for sig, previous in self._saved.items():
            signal.signal(sig, previous)
        self._saved = {}
        self.signals = []
        self._stop_reader()
        self.received = self.received_at = None

    def _record(self, signum: int) -> None:
        if self.received is None:
            self.received_at = time.monotonic()
            self.received = signal.Signals(signum)

    def _handle(self, signum: int, frame) -> None:
        self._record(signum)

    def _start_reader(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C-level handler must never block
        self._pipe = (read_fd, write_fd)
        self._saved_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._first_seen_at = None
        self._reader = threading.Thread(target=self._read, args=(read_fd,), name="preemption-signals", daemon=True)
        self._reader.start()

    def _stop_reader(self) -> None:
        if self._reader is None:
            return
        signal.set_wakeup_fd(self._saved_wakeup if self._saved_wakeup is not None else -1)
        read_fd, write_fd = self._pipe
        os.write(write_fd, b"\0")  # no signal has number 0: the reader's cue to end
        self._reader.join(timeout=5)
        os.close(read_fd)
        os.close(write_fd)
        self._reader = self._pipe = self._saved_wakeup = None

    def _read(self, read_fd: int) -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum == 0:
                    return
                if signum not in self.signals:
                    continue  # another handler's signal (SIGINT...)
                now = time.monotonic()
                if self._first_seen_at is None:
                    self._first_seen_at = now
                elif signum == signal.SIGTERM and now - self._first_seen_at >= SECOND_SIGTERM_AFTER_S:
                    _exit_at_once()
                self._record(signum)


def _exit_at_once() -> None:
    """A second SIGTERM: the scheduler will not wait any longer. One line, exit 143, nothing saved."""
    line = ("preemption: a second SIGTERM arrived before the checkpoint was saved; exiting at once without it "
            "(the last published checkpoint stays the latest)")
    report_line(line)
    os._exit(EXIT_SECOND_SIGTERM)


_recorder = _Recorder()


def listen(signals: list[signal.Signals]) -> None:
    """Record `signals` from now on in this process (the main thread's), and only those: a signal listed before
    and not now gets its previous handler back. Call again to change the set; `stop_listening` to end."""
    _recorder.listen(signals)


def stop_listening() -> None:
    """Restore the signal handlers from before the first `listen` and forget a recorded signal."""
    _recorder.stop()


@dataclasses.dataclass
class Stop:
    """What a preemption ended with, for its line: the signal, when it came, and what was saved."""

    signal_name: str
    received_at: float
    step: int
    path: str | None = None
    save_seconds: float = 0.0

    def line(self) -> str:
        """The line of the preemption; the time to the exit is counted up to this call (just before the exit)."""
        to_exit = f"exiting {time.monotonic() - self.received_at:.1f} s after the signal"
        if self.path is None:
            return (f"preempted by {self.signal_name} before step {self.step + 1} finished: nothing new to save, "
                    f"{to_exit}")
        return (f"preempted by {self.signal_name}: checkpoint of step {self.step} saved to {self.path} in "
                f"{self.save_seconds:.1f} s, {to_exit}; the same command resumes from it")


class Preemption:
    """The preemption signals of one trainer and the agreement across ranks (see the module docstring).

    signals: what to record (empty: nothing is installed and `requested` is always False; a signal recorded before,
        under the default signals, then takes its default action).
    group: the process group to agree over (a gloo group of its own, so that the flag is a CPU tensor and the poll
        never waits for a device), or None in a single process.
    """

    def __init__(self, signals: list[signal.Signals], group) -> None:
        import torch  # here, not at the top: `listen` runs before a rank's slow imports

        listen(signals)
        self.signals = list(_recorder.signals)
        self.group = group
        self.received: signal.Signals | None = None
        """The signal the ranks agreed on (the largest number any rank got), once `requested` said so."""
        self.received_at: float | None = None
        self._flag = torch.zeros(1, dtype=torch.int32)

    def requested(self) -> bool:
        """Whether any rank received a preemption signal; collective: every rank calls it at the same points."""
        import torch.distributed as dist

        if not self.signals:
            return False
        if self.received is not None:
            return True
        self._flag.fill_(int(_recorder.received or 0))
        if self.group is not None:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        signum = int(self._flag.item())
        if signum:
            self.received = signal.Signals(signum)
            # a rank that got no signal itself counts from this poll
            self.received_at = _recorder.received_at if _recorder.received is not None else time.monotonic()
        return bool(signum)

    def stop(self, step: int, path: str | None = None, save_seconds: float = 0.0) -> Stop:
        """The record of this preemption: `step` saved to `path` (None: nothing new was saved)."""
        return Stop(self.received.name, self.received_at, step, path, save_seconds)

    def close(self) -> None:
        """Restore the handlers that were installed before (a test runs several jobs in one process)."""
        stop_listening()
